"""An in-process `LLM` killed by SIGKILL: its KV segment carries an owner record, so the next
`sweep_stale()` or the next `LLM` start removes it at once (no 600 s orphan grace). Real
processes: a child runs `LLM(...)` on the default model and is SIGKILLed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

from e2e_helpers import ROOT, env, shm_entries

from pipeline.ipc.sweep import sweep_stale
from pipeline.llm import LLM
from pipeline.sampling_params import SamplingParams

ENGINE = dict(device="cpu", dtype="float32", block_size=16, num_blocks=32, max_model_len=128)
CHILD = f"""
import sys
from pipeline.llm import LLM
llm = LLM(skip_tokenizer_init=True, **{ENGINE!r})
print(llm.config.instance_id, flush=True)
sys.stdin.read()  # hold the KV cache until killed
"""


def _killed_llm() -> str:
    """Start a child holding an LLM, SIGKILL it, return its instance id (its debris stays)."""
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env())
    try:
        iid = p.stdout.readline().strip()
        assert iid, p.stderr.read()
        assert f"pipeline.{iid}.kv" in shm_entries(iid)
    finally:
        p.kill()
        p.communicate(timeout=60)
    assert p.returncode == -signal.SIGKILL
    return iid


def test_sigkilled_llm_segment_is_swept_at_once():
    iid = _killed_llm()
    left = shm_entries(iid)
    assert f"pipeline.{iid}.kv" in left and f"pipeline.{iid}.owner" in left
    removed = sweep_stale()
    assert set(left) <= set(removed)
    assert shm_entries(iid) == []


def test_next_llm_start_removes_a_killed_llms_segment():
    iid = _killed_llm()
    with LLM(skip_tokenizer_init=True, **ENGINE) as llm:
        assert shm_entries(iid) == []
        mine = llm.config.instance_id
        assert mine.startswith(f"{os.getpid()}-")
        assert shm_entries(mine) == [f"pipeline.{mine}.kv", f"pipeline.{mine}.owner"]
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))[0]
        assert len(out.outputs[0].token_ids) == 2
    assert shm_entries(mine) == []


def test_served_kv_cache_is_a_view_swept_with_its_owner():
    # Served: the gateway owns the instance; the worker's KV segment records no owner of its
    # own and goes when the gateway is dead, even while its creator still maps it.
    import torch
    from ipc_procs import CTX, make_instance_and_wait

    from pipeline.worker.kv_cache import KVCache

    parent, child = CTX.Pipe()
    gateway = CTX.Process(target=make_instance_and_wait, args=(child, False), daemon=True)
    gateway.start()
    assert parent.poll(30), "the owner did not report its instance"
    iid = parent.recv()
    kv = KVCache(2, 4, 16, 2, 8, torch.float32, torch.device("cpu"), instance_id=iid)
    try:
        assert f"pipeline.{iid}.kv" in shm_entries(iid) and len(shm_entries(iid)) == 8
        gateway.kill()
        gateway.join(20)
        sweep_stale()
        assert shm_entries(iid) == []
        kv.k_caches[0].fill_(1.0)  # the mapping outlives the name
    finally:
        kv.close()
    assert shm_entries(iid) == []
