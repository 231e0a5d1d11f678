"""The CPU KV cache's default size (worker/kv_sizing.py): sized to the model (as much as its
weights, at least 64 MiB and one max_model_len sequence, at most what max_num_seqs sequences
fill and half the free memory), the flags that override it, and a segment whose pages are
reserved in /dev/shm at start-up.
"""
from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st
from model_driver import make_runner

from pipeline.config import DEFAULT_MODEL
from pipeline.worker.kv_sizing import MIN_CPU_KV_BYTES, default_cpu_kv_bytes

MiB, GiB = 1 << 20, 1 << 30


@given(per_block=st.integers(1, 1 << 22), blocks_per_seq=st.integers(1, 1 << 14),
       seqs=st.integers(1, 1024), weights=st.integers(0, 1 << 40), avail=st.integers(0, 1 << 42))
def test_default_holds_one_sequence_and_never_more_than_the_engine_can_fill(
        per_block, blocks_per_seq, seqs, weights, avail):
    n = default_cpu_kv_bytes(per_block, blocks_per_seq, seqs, weights, avail)
    one_seq = per_block * blocks_per_seq
    assert one_seq <= n <= one_seq * seqs
    # Within those two, the weights' size (at least the floor), capped by half the memory.
    budget = min(max(weights, MIN_CPU_KV_BYTES), avail // 2)
    assert n == max(one_seq, min(budget, one_seq * seqs))
    # More weights never shrink it.
    assert default_cpu_kv_bytes(per_block, blocks_per_seq, seqs, weights * 2, avail) >= n


@pytest.mark.parametrize("what, per_token, max_model_len, weights, want", [
    # The 7 MB default model (bf16 KV, 2 KiB a token): 64 MiB, not the 1 GiB that 256
    # sequences of 2048 tokens could fill.
    ("default model", 2 * 1024, 2048, 13 * MiB, 64 * MiB),
    # Qwen2.5-0.5B's shape in bf16 (12 KiB a token): as much as its ~1 GB of weights.
    ("0.5B bf16", 12 * 1024, 2048, 988 * MiB, 988 * MiB),
    # An 8B Llama-3 in bf16 (128 KiB a token) at 128k: its one full sequence, 16 GiB.
    ("8B at 128k", 128 * 1024, 131072, 15 * GiB, 16 * GiB),
    # A context short enough that 256 full sequences fit below the weights: that, no more.
    ("short context", 2 * 1024, 64, 100 * MiB, 256 * 64 * 2 * 1024),
])
def test_default_examples(what, per_token, max_model_len, weights, want):
    block = 16
    assert default_cpu_kv_bytes(per_token * block, max_model_len // block, 256, weights, 64 * GiB) == want, what


def test_default_model_gets_64_mib_reserved():
    runner = make_runner(DEFAULT_MODEL, dtype="auto", num_blocks=0, max_num_seqs=256)
    try:
        assert runner.max_model_len == 2048
        assert runner.kv_cache_bytes == 64 * MiB
        assert runner.num_blocks * runner.block_size >= runner.max_model_len
        # 64 MiB in /dev/shm, reserved (a full /dev/shm fails at start-up, not at a write),
        # where the 1 GiB default of before reserved 16x that for a 7 MB model.
        name = runner.kv_cache.shm_name.lstrip("/")
        assert os.stat(f"/dev/shm/{name}").st_size == 64 * MiB
        assert os.stat(f"/dev/shm/{name}").st_blocks * 512 >= 64 * MiB
    finally:
        runner.close()


@pytest.mark.parametrize("flags, blocks", [({"num_blocks": 200}, 200),
                                           ({"kv_cache_memory": 3 * MiB}, 3 * MiB // (32 * 1024))])
def test_flags_override_the_default(flags, blocks):
    runner = make_runner(DEFAULT_MODEL, dtype="auto", max_model_len=512, **{"num_blocks": 0, **flags})
    try:
        assert runner.num_blocks == blocks
    finally:
        runner.close()


def test_a_draft_models_kv_is_counted_in_the_budget(tmp_path):
    """With a draft model, --kv-cache-memory (and the default budget) pays for the target's
    and the draft's KV together: blocks = budget // (both bytes per block)."""
    from pipeline.bench.spec import random_draft
    from pipeline.worker.spec.draft import draft_kv_bytes_per_block
    spec = {"method": "draft_model", "model": random_draft(DEFAULT_MODEL, tmp_path / "draft"),
            "num_speculative_tokens": 2}
    # The random draft: 1 layer, 1 KV head of 64, float32: 8 KiB a 16-token block.
    draft = 1 * 2 * 16 * 1 * 64 * 4
    for flags, budget in (({"kv_cache_memory": 3 * MiB, "max_model_len": 512}, 3 * MiB),
                          ({"max_num_seqs": 256}, 64 * MiB)):  # the default model's default budget
        runner = make_runner(DEFAULT_MODEL, dtype="auto", num_blocks=0, speculative_config=spec, **flags)
        try:
            target = runner.kv_cache.layout.bytes_per_block
            assert runner.draft_block_bytes == draft == draft_kv_bytes_per_block(
                runner.config, spec["model"], 16, runner.device)
            assert runner.num_blocks == budget // (target + draft)
            assert runner.spec.draft.kv_bytes == draft * runner.num_blocks
            assert runner.kv_cache_bytes == runner.kv_cache.layout.total_bytes + runner.spec.draft.kv_bytes
            assert budget - (target + draft) < runner.kv_cache_bytes <= budget
        finally:
            runner.close()
