"""The KV disk tier under tensor parallelism on one host (issue 26): the ranks share one KV
segment (worker/kv_cache.py), so the cache messager saves and loads every rank's part of a
block in one file. Greedy outputs of ``LLM(tensor_parallel_size=2, kv_offload_dir=...)``
equal those without the tier, and a restart on the directory loads every rank's KV back
(a rank whose half were missing would compute from zeros: other tokens).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline import LLM
from pipeline.config import DEFAULT_MODEL, EngineConfig
from pipeline.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not (Path(DEFAULT_MODEL) / "model.safetensors").is_file(),
                                reason="default model not built")

BS = 16
PREFIX = [7 + (i * 37) % 1900 for i in range(4 * BS)]  # 4 shared blocks
PROMPTS = [PREFIX + [100 + s, 200 + s, 300 + s] for s in range(4)]
SP = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _run(tier: str | None) -> tuple[list[list[int]], dict]:
    kw: dict = {"kv_offload_dir": tier, "kv_offload_size": "256MiB"} if tier else {}
    llm = LLM(str(DEFAULT_MODEL), tensor_parallel_size=2, device="cpu", dtype="float32",
              worker_threads=1, block_size=BS, num_blocks=64, max_model_len=128, **kw)
    try:
        outs = llm.generate(PROMPTS, SP, use_tqdm=False)
        st = llm.stats()
    finally:
        iid = llm.config.instance_id
        llm.close()
    assert not [n for n in os.listdir("/dev/shm") if iid in n]
    return [list(o.outputs[0].token_ids) for o in outs], st


def test_tp2_outputs_with_the_tier_equal_those_without_and_a_restart_loads_every_rank(tmp_path):
    reference, _ = _run(None)
    first, st = _run(str(tmp_path))
    assert first == reference
    assert st["kv_tier_saved_blocks"] >= 4 and st["kv_tier_loaded_tokens"] == 0
    second, st = _run(str(tmp_path))  # a fresh pool: the shared prefix comes from the files
    assert second == reference
    assert st["kv_tier_loaded_tokens"] >= 4 * BS and st["kv_tier_failed_blocks"] == 0


def test_a_tier_across_hosts_is_refused_naming_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--kv-offload-dir with --nnodes > 1"):
        EngineConfig.of(model=str(DEFAULT_MODEL), tensor_parallel_size=2, nnodes=2, master_port=29500,
                        kv_offload_dir=str(tmp_path)).check()
