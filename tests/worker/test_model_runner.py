"""ModelRunner behaviour beyond parity: the shared-memory KV cache and its lifetime, cache
sizing, the per-step diff (preemption/resume, block copies, chunked prefill), the layer
signal, seeded sampling and logprobs through the runner, and bad step plans."""
from __future__ import annotations

import os
import stat

import pytest
import torch
from model_driver import Driver, make_runner, tiny_hf_model

from pipeline.ipc.instance import Instance, list_entries
from pipeline.ipc.layer_signal import LayerSignal
from pipeline.ipc.segment import attach_segment
from pipeline.messages import CachedRequestData, NewRequestData, SchedulerOutput, ids_to_bytes
from pipeline.sampling_params import SamplingParams

PROMPT = [(7 * i + 3) % 300 + 3 for i in range(37)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    path = str(tmp_path_factory.mktemp("llama"))
    tiny_hf_model("llama", path, seed=11)
    yield path
    torch.set_num_threads(old)


@pytest.fixture
def runner(model_dir):
    r = make_runner(model_dir)
    iid = r.config.instance_id
    yield r
    r.close()
    assert list_entries(iid) == []


def test_kv_cache_is_a_private_named_segment_another_process_can_map(runner):
    spec, shm_name = runner.kv_cache.layout, runner.kv_cache.shm_name
    assert shm_name is not None
    path = "/dev/shm" + shm_name
    assert shm_name == f"/pipeline.{runner.config.instance_id}.kv"
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == spec.total_bytes
    d = Driver(runner)
    d.add("a", PROMPT, 2)
    d.run()
    seg = attach_segment(shm_name)  # what the cache messager does
    try:
        other = torch.frombuffer(seg, dtype=torch.uint8).view(getattr(torch, spec.dtype)).view(
            spec.num_layers, 2, spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        block = d.keep["a"].blocks[1]
        assert torch.equal(other[1, 0, block], runner.kv_cache.k_caches[1][block])
        assert other[1, 1, block].abs().sum() > 0
        del other
    finally:
        seg.close()
    runner.close()
    assert not os.path.exists(path)


def test_num_blocks_from_memory_budget_and_clear_error(model_dir):
    r = make_runner(model_dir, num_blocks=0, kv_cache_memory=1 << 20, max_model_len=256)
    try:
        per_block = 2 * 2 * 16 * 2 * 16 * 4  # K+V, layers, block, kv heads, head dim, fp32
        assert r.num_blocks == (1 << 20) // per_block
    finally:
        r.close()
    with pytest.raises(ValueError, match="cannot hold one sequence of max_model_len=512.*--kv-cache-memory"):
        make_runner(model_dir, num_blocks=0, kv_cache_memory=64 << 10)


def test_preempted_request_resumes_with_identical_output(runner):
    ref = Driver(runner)
    ref.add("r", PROMPT, 30)
    want = ref.run()["r"]
    ref.release("r")
    d = Driver(runner)
    d.add("r", PROMPT, 30)
    d.add("bystander", PROMPT[:9], 30)
    for _ in range(12):
        d.step()
    done = d.preempt("r")
    d.step()  # the runner drops the row
    assert "r" not in runner.batch
    d.add("r", done.tokens, 30 - len(done.output), num_prompt=len(PROMPT))
    got = d.run()
    assert done.output + got["r"] == want


def test_chunked_prefill_samples_only_at_the_end(runner):
    d = Driver(runner, token_budget=16)
    d.add("a", PROMPT, 3)
    d.step()
    d.step()
    assert [o.req_ids for o in d.outputs] == [[], []]
    d.step()  # 37 tokens: the third chunk completes the prompt
    assert d.outputs[-1].req_ids == ["a"]
    d.run()


def test_layer_signal_published_per_layer(runner):
    with Instance(f"sig{os.getpid():x}") as inst:
        sig = LayerSignal.create(inst, "layers", runner.num_layers)
        reader = LayerSignal.attach(sig.name)
        runner.attach_layer_signal(sig)
        try:
            d = Driver(runner)
            d.add("a", PROMPT, 3)
            d.run()
            last = d.step_id - 1  # the final step only flushed finish notices
            for layer in range(runner.num_layers):
                assert reader.published(layer) == last
                reader.wait(last, layer, timeout=1.0)
        finally:
            runner.attach_layer_signal(None)
            reader.close()
            sig.close()


def test_seeded_sampling_ignores_batch_company_and_logprobs_flow(runner):
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=12, logprobs=3)

    def sample(company: int) -> tuple[list[int], list]:
        d = Driver(runner)
        d.add("s", PROMPT, 12, params=sp)
        for i in range(company):
            d.add(f"o{i}", PROMPT[i:i + 20], 12, params=SamplingParams(temperature=1.0, max_tokens=12))
        d.run()
        lps = [lp for o in d.outputs for rid, lp in zip(o.req_ids, o.logprobs) if rid == "s"]
        return d.keep["s"].output, lps

    alone, lps = sample(0)
    crowded, _ = sample(3)
    assert alone == crowded
    assert [lp.token_id for lp in lps] == alone
    assert all(len(lp.top_ids) == 3 and lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
               for lp in lps)


def test_bad_step_plans_are_rejected(runner):
    with pytest.raises(ValueError, match="'ghost' is not in the worker's batch"):
        runner.execute(SchedulerOutput(1, [], [CachedRequestData("ghost", [], 0)], {"ghost": 1}, 1, [], []))
    new = NewRequestData("a", ids_to_bytes(PROMPT[:5]), 5, SamplingParams(), [0], 0)
    with pytest.raises(ValueError, match="up to token 6; it has 5 known tokens"):
        runner.execute(SchedulerOutput(2, [new], [], {"a": 6}, 6, [], []))
    long = NewRequestData("b", ids_to_bytes(PROMPT), len(PROMPT), SamplingParams(), [0, 1], 0)
    with pytest.raises(ValueError, match="up to token 37; it has 37 known tokens and 2 blocks of 16"):
        runner.execute(SchedulerOutput(3, [long], [], {"b": 37}, 37, ["a"], []))


def test_bfloat16_runs_with_a_bf16_cache(model_dir):
    r = make_runner(model_dir, dtype="bfloat16")
    try:
        assert r.kv_cache.k_caches[0].dtype == torch.bfloat16
        d = Driver(r)
        d.add("a", PROMPT, 8)
        assert len(d.run()["a"]) == 8
    finally:
        r.close()


def test_dtype_auto_avoids_emulated_half_types_on_cpu():
    from pipeline.worker.device import cpu_has_fast_bf16, resolve_dtype
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", "float16", cpu) == torch.float32
    assert resolve_dtype("auto", "bfloat16", cpu) == (torch.bfloat16 if cpu_has_fast_bf16() else torch.float32)
    # with the C ops a bf16 checkpoint stays bf16 on any CPU (packed, float32 FMAs on AVX2)
    assert resolve_dtype("auto", "bfloat16", cpu, have_ops=True) == torch.bfloat16
    assert resolve_dtype("auto", "float16", cpu, have_ops=True) == torch.float32
    assert resolve_dtype("bfloat16", "float32", cpu) == torch.bfloat16
    assert resolve_dtype("auto", "bfloat16", torch.device("cuda", 0)) == torch.bfloat16
    with pytest.raises(ValueError, match="--dtype must be one of"):
        resolve_dtype("float64", "float32", cpu)
