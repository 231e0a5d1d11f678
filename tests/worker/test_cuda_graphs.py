"""Worker: CUDA graphs for decode steps (pipeline/worker/cuda_graphs.py).

The size arithmetic runs everywhere; the rest needs a GPU: decode through the captured graphs
equals the eager forward (tokens, and every K/V slot of the cache, so padding rows wrote
nothing), across batch sizes that need padding, with requests finishing, a preemption and a
chunked prefill in between."""
from __future__ import annotations

import pytest
import torch
from conftest import cuda_skip_reason
from model_driver import Driver, make_runner, tiny_hf_model

from pipeline.worker.cuda_graphs import MAX_CAPTURE_SIZE, capture_sizes

needs_cuda = pytest.mark.skipif(cuda_skip_reason() is not None, reason=str(cuda_skip_reason()))


@pytest.mark.parametrize("max_num_seqs", [1, 2, 3, 8, 9, 17, 24, 256, 300, 1024])
def test_capture_sizes_cover_every_batch(max_num_seqs):
    sizes = capture_sizes(max_num_seqs)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1
    assert sizes[-1] == min(max_num_seqs, MAX_CAPTURE_SIZE)
    for n in range(1, sizes[-1] + 1):
        padded = min(s for s in sizes if s >= n)
        assert padded - n <= 15 and (n > 8 or padded < 2 * n)


def test_no_graphs_on_cpu(tmp_path):
    tiny_hf_model("llama", str(tmp_path))
    runner = make_runner(str(tmp_path))
    try:
        assert runner.graphs is None
    finally:
        runner.close()


@needs_cuda
def test_enforce_eager_captures_no_graphs(tmp_path):
    tiny_hf_model("llama", str(tmp_path))
    runner = make_runner(str(tmp_path), device="cuda", enforce_eager=True)
    try:
        assert runner.graphs is None
    finally:
        runner.close()


def _drive(runner, prompts, preempt_at=None):
    d = Driver(runner, token_budget=40)  # the long prompt is chunked over several steps
    for i, (p, n) in enumerate(prompts):
        d.add(f"r{i}", p, n)
    steps = 0
    while d.step():
        steps += 1
        if steps == preempt_at:  # recompute preemption: the row drops, then comes back
            r = d.preempt("r1")
            d.add("r1b", r.tokens, r.max_tokens - len(r.output))
    d.step_id += 1
    from pipeline.messages import SchedulerOutput
    runner.execute(SchedulerOutput(d.step_id, [], [], {}, 0, d.finished, []))
    return {rid: r.output for rid, r in d.keep.items()}


@needs_cuda
def test_graph_decode_equals_eager(tmp_path):
    tiny_hf_model("llama", str(tmp_path), seed=3, num_key_value_heads=1)
    g = torch.Generator().manual_seed(0)
    lens = [5, 17, 3, 60, 9, 33, 12, 1, 21, 7, 40, 2]
    outs = [4, 9, 20, 6, 13, 2, 17, 8, 11, 5, 3, 15]  # the batch shrinks through 12..1
    prompts = [(torch.randint(3, 320, (n,), generator=g).tolist(), m) for n, m in zip(lens, outs)]
    runs = {}
    for graphs in (True, False):
        runner = make_runner(str(tmp_path), device="cuda", num_blocks=128, max_num_seqs=24)
        try:
            assert runner.graphs is not None and runner.graphs.sizes == [1, 2, 4, 8, 16, 24]
            if not graphs:
                runner.graphs = None
            for k, v in runner.kv_cache.layers:  # untouched slots must stay exactly zero
                k.zero_()
                v.zero_()
            result = _drive(runner, prompts, preempt_at=5)
            replays = runner.graphs.replays if graphs else 0
            kv = [torch.stack([k, v]).cpu() for k, v in runner.kv_cache.layers]
            runs[graphs] = (result, replays, kv)
        finally:
            runner.close()
    (got, replays, kv_graph), (want, _, kv_eager) = runs[True], runs[False]
    assert replays >= 8, f"only {replays} decode steps replayed a graph"
    assert got == want
    for layer, (a, b) in enumerate(zip(kv_graph, kv_eager)):
        assert torch.equal(a == 0, b == 0), f"layer {layer}: graph padding wrote K/V slots"
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
