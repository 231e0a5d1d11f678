"""Embeddings (worker/pooling.py through LLM.embed): the pooled vector is transformers' final
hidden state (after the final norm: ``LlamaModel.last_hidden_state``) of the default model,
last token or mean over the prompt, L2-normalised; a prompt run in several prefill chunks
gives the same vector as in one; embedding requests share steps with generation.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline import LLM
from pipeline.config import DEFAULT_MODEL
from pipeline.sampling_params import SamplingParams

PROMPTS = [[(7 * i + 3) % 2000 + 4 for i in range(37)], [5, 9, 13], [42]]
SMALL = dict(device="cpu", dtype="float32", block_size=8, num_blocks=64, max_model_len=128)


@pytest.fixture(scope="module")
def hf():
    from transformers import LlamaModel

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    model = LlamaModel.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    yield model
    torch.set_num_threads(old)


def oracle(hf, ids: list[int], pooling: str) -> np.ndarray:
    with torch.no_grad():
        h = hf(torch.tensor([ids])).last_hidden_state[0]
    v = h[-1] if pooling == "last" else h.mean(0)
    return (v / v.norm()).numpy()


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_equals_transformers_chunked_or_not(hf, pooling):
    vectors = {}
    for budget in (2048, 8):  # 8: the 37-token prompt runs in 5 chunks
        with LLM(pooling=pooling, max_num_batched_tokens=budget, **SMALL) as llm:
            outs = llm.embed(PROMPTS)
        vectors[budget] = [np.asarray(o.outputs.embedding) for o in outs]
        for o, ids in zip(outs, PROMPTS):
            assert o.prompt_token_ids == ids and o.error is None
            got = np.asarray(o.outputs.embedding)
            assert got.shape == (256,)
            np.testing.assert_allclose(got, oracle(hf, ids, pooling), atol=2e-5)
    for a, b in zip(vectors[2048], vectors[8]):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_mean_and_last_differ_and_prefix_cache_hits(hf):
    # A prompt whose blocks are cached by the first request: last pooling may take the hit
    # (the last token is always computed), mean pooling must not (it sums every position).
    ids = PROMPTS[0]
    for pooling in ("last", "mean"):
        with LLM(pooling=pooling, **SMALL) as llm:
            first = llm.embed([ids])[0].outputs.embedding
            again = llm.embed([ids])[0].outputs.embedding
            hits = llm.stats()["prefix_cache_hit_tokens"]
        np.testing.assert_allclose(again, first, atol=1e-6)
        np.testing.assert_allclose(again, oracle(hf, ids, pooling), atol=2e-5)
        assert (hits > 0) == (pooling == "last")


def test_embed_batches_with_generation():
    # One engine, generate and embed requests in the same steps: an embedding request ends
    # with its prefill (no token), the generation beside it is what it is alone.
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(max_num_batched_tokens=16, **SMALL) as llm:  # the long prompt takes several steps
        alone = llm.generate([[3, 4, 5, 6]], sp)[0].outputs[0].token_ids
        ref = [o.outputs.embedding for o in llm.embed(PROMPTS)]
        # Queue a generation and embeddings together; run them in one loop.
        batch = llm._read([[3, 4, 5, 6]], [sp], [0], None) + \
            llm._read(PROMPTS, [SamplingParams()] * 3, [0] * 3, None, embed=True)
        steps: list[set[str]] = []
        real = llm.scheduler.schedule

        def schedule():
            out = real()
            steps.append(set(out.num_scheduled_tokens))
            return out

        llm.scheduler.schedule = schedule  # type: ignore[method-assign]
        outs = llm._run_batch(batch, False, lambda r, pr: r)
    gen, embeds = outs[0], outs[1:]
    assert gen.token_ids == alone and gen.embedding is None
    for r, want in zip(embeds, ref):
        assert r.token_ids == [] and r.finish_reason == "stop" and r.usage.completion_tokens == 0
        np.testing.assert_allclose(r.embedding, want, atol=1e-6)
    rids = [pr.rid for pr in batch]
    # The generation decoded in steps that also prefilled embeddings.
    assert any(rids[0] in s and len(s & set(rids[1:])) > 0 for s in steps[1:])
    assert len(steps) > 3
    assert llm.worker is None  # closed: the KV cache is released


def test_embed_refusals():
    with LLM(**SMALL) as llm:
        with pytest.raises(ValueError, match="prompt_token_ids"):
            llm.embed([[]])
        with pytest.raises(ValueError, match="128"):
            llm.embed([[5] * 129])
        assert len(llm.embed([[5] * 128])[0].outputs.embedding) == 256  # all of max_model_len
        out = llm.embed([[5] * 100], truncate_prompt_tokens=10)[0]
        assert out.prompt_token_ids == [5] * 10
