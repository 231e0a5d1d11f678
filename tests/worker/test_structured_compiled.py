"""Issue 25 item 7: the worker never compiles a grammar the tokenizer stage compiled. The
engine sends the compiled grammar (``EngineRequest.grammar``) with every NewRequestData of the
request, a resumed one included, and rank 0's StructuredBatch loads it: no compile runs in the
worker (counted), and the masks and the accepted tokens are those of a local compile."""
from __future__ import annotations

import time

import torch

from pipeline.config import DEFAULT_MODEL, EngineConfig
from pipeline.engine.fake_worker import FakeWorker
from pipeline.engine.scheduler import Scheduler
from pipeline.messages import EngineRequest, ids_to_bytes
from pipeline.sampling_params import SamplingParams
from pipeline.sampling_params.structured import StructuredOutputsParams
from pipeline.structured_outputs import Grammars, to_bytes
from pipeline.worker.structured import StructuredBatch

VOCAB, EOS = 2048, [1]
SPECS = [StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": "integer"}},
                                       "required": ["n"]}),
         StructuredOutputsParams(regex=r"[a-z]{2,5}-[0-9]"),
         StructuredOutputsParams(choice=["alpha", "beta"])]


def test_a_compiled_grammar_loads_without_a_compile_and_masks_as_one():
    compiled = [to_bytes(Grammars(DEFAULT_MODEL, VOCAB, EOS).compile(so)) for so in SPECS]
    shipped, local = StructuredBatch(DEFAULT_MODEL, VOCAB, EOS), StructuredBatch(DEFAULT_MODEL, VOCAB, EOS)
    try:
        ids = [f"r{i}" for i in range(len(SPECS))]
        for rid, so, blob in zip(ids, SPECS, compiled, strict=True):
            shipped.add(rid, so, [], blob)
            local.add(rid, so, [])
        gen = torch.Generator().manual_seed(0)
        for _ in range(12):
            logits = torch.randn(len(ids), VOCAB, generator=gen)
            masked = []
            for sb in (shipped, local):
                sb.start_masks(list(ids))
                x = logits.clone()
                sb.apply_masks(x)
                masked.append(x)
            assert torch.equal(masked[0], masked[1])
            tokens = masked[0].argmax(dim=1).tolist()
            shipped.accept(list(ids), tokens)
            local.accept(list(ids), tokens)
        assert shipped.compiles == 0 and local.compiles == len(SPECS)
    finally:
        shipped.close()
        local.close()


def test_every_new_request_data_carries_the_grammar_resumed_ones_too():
    cfg = EngineConfig.of(max_num_seqs=8, max_num_batched_tokens=64, long_prefill_token_threshold=0,
                          preemption_policy="newest", enable_prefix_caching=False)
    sched = Scheduler(cfg, 12, 4, 128, hash_key=b"test")
    worker = FakeWorker(12, 4, 128, 48, [0], check_kv=True)
    blobs = {f"g{i}": bytes([i]) * (100 + i) for i in range(4)}
    for rid, blob in blobs.items():  # 4 x (8 + 16) tokens in 12 blocks of 4: preemptions
        sched.add_request(EngineRequest(rid, ids_to_bytes(list(range(2, 10))), SamplingParams(
            max_tokens=16, ignore_eos=True, structured_outputs=SPECS[1]), time.time(), [0], grammar=blob))
    sched.add_request(EngineRequest("plain", ids_to_bytes([3, 4]), SamplingParams(max_tokens=4), time.time(), [0]))
    sent: dict[str, int] = {}
    steps = 0
    while sched.has_unfinished_requests():
        so = sched.schedule()
        for new in so.new_reqs:
            assert new.grammar == blobs.get(new.req_id), new.req_id
            sent[new.req_id] = sent.get(new.req_id, 0) + 1
        sched.update_from_output(so, worker.execute(so))
        steps += 1
        assert steps < 2000
    assert sched.num_preemptions > 0 and max(sent.values()) > 1, sent
