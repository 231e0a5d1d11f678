"""Speculative decoding on CUDA (issue 27; runs where a device is lent: tools/gpu_check.sh):
greedy outputs with n-gram drafts equal plain decoding, the verify steps running eagerly
beside the captured decode graphs of the steps without drafts, and with a draft model.
Skipped without a CUDA device.
"""
from __future__ import annotations

import pytest
from conftest import cuda_skip_reason

from pipeline import LLM
from pipeline.config import DEFAULT_MODEL
from pipeline.sampling_params import SamplingParams

needs_cuda = pytest.mark.skipif(cuda_skip_reason() is not None, reason=str(cuda_skip_reason()))

PROMPTS = [[7 + (i * 31 + j * 7) % 1900 for j in range(40)] * 2 for i in range(6)]  # repeats: drafts
SP = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


def _run(spec: dict | None) -> tuple[list[list[int]], dict]:
    # num_blocks: the GPU tests run 4 at a time on one GPU, and a profiled budget (0.9 of the
    # device less what other processes hold) leaves a second instance no blocks.
    with LLM(DEFAULT_MODEL, device="cuda", dtype="float32", max_model_len=512, num_blocks=256,
             speculative_config=spec) as llm:
        outs = llm.generate(PROMPTS, SP, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], llm.stats()


@needs_cuda
@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "cost_aware": False},
    {"method": "draft_model", "model": DEFAULT_MODEL, "num_speculative_tokens": 3, "cost_aware": False},
], ids=["ngram", "draft_model"])
def test_cuda_speculation_equals_plain_decoding(spec):
    want, _ = _run(None)
    got, st = _run(spec)
    assert got == want
    assert st["spec_num_accepted_tokens"] > 0
