"""The small-batch decoder stack in one C call (cpu_ops_decoder.h via
layers/fused_decoder.py): the same floats as the per-layer Python loop over the same kernels,
for float32, bf16, int8 and int4 weights, biases, tied embeddings and a batch of up to eight
(the bf16/int8 projections on the GEMV for one row, on AMX tiles beyond, where the CPU has
them), and, with packed weights, the 80-token prefill of the eight prompts too."""
from __future__ import annotations

import pytest
import torch
from model_driver import Driver, make_runner, tiny_hf_model

from pipeline.layers import ops

pytestmark = pytest.mark.skipif(ops.backend(torch.device("cpu")) is None, reason="C CPU ops not built")
FORMATS = {"float32": {}, "bf16": {"dtype": "bfloat16"}, "int8": {"quantization": "int8"},
           "int4": {"quantization": "int4"}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("decoder-c"))
    tiny_hf_model("llama", path, seed=5, attention_bias=True, mlp_bias=True, num_key_value_heads=2)
    return path


def generate(model_dir: str, fmt: str, use_table: bool) -> tuple[list[torch.Tensor], dict]:
    """Greedy continuations of 8 prompts decoded together; every step's logits."""
    runner = make_runner(model_dir, worker_threads=1, **FORMATS[fmt])
    model = runner.model
    logits: list[torch.Tensor] = []
    compute = model.compute_logits

    def record(hidden):
        out = compute(hidden)
        logits.append(out.clone())
        return out

    model.compute_logits = record
    if not use_table:  # the cache key matches, the table is None: the Python loop runs
        layers = runner.kv_cache.layers
        model._c_layer_table = ((id(layers), layers[0][0].data_ptr()), None)
    try:
        d = Driver(runner)
        g = torch.Generator().manual_seed(7)
        for i in range(8):  # as many as one C call takes
            d.add(f"r{i}", torch.randint(3, runner.vocab_size, (3 + 2 * i,), generator=g).tolist(), 12)
        out = d.run()
        if use_table:
            assert model._c_layer_table[1] is not None, "the C table was not used"
        return logits, out
    finally:
        runner.close()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_one_c_call_matches_the_python_loop_bit_for_bit(model_dir, fmt):
    c_logits, c_out = generate(model_dir, fmt, use_table=True)
    py_logits, py_out = generate(model_dir, fmt, use_table=False)
    assert c_out == py_out
    assert len(c_logits) == len(py_logits) >= 12
    for a, b in zip(c_logits, py_logits):
        assert torch.equal(a, b)


def test_a_bad_slot_still_gets_the_checked_error(model_dir):
    """The one C call checks index values itself; a bad one fails in layer 0 and the checked
    Python path then names it, as it did before."""
    from pipeline.messages import NewRequestData, SchedulerOutput, ids_to_bytes
    from pipeline.sampling_params import SamplingParams

    runner = make_runner(model_dir, worker_threads=1)
    try:
        sched = SchedulerOutput(1, [NewRequestData("r", ids_to_bytes([5, 6, 7]), 3,
                                                   SamplingParams(max_tokens=2), [0], 0)],
                                [], {"r": 3}, 3, [], [])
        runner._apply_diff(sched)
        inp = runner.prepare_inputs(sched)
        inp.meta.slot_mapping[1] = 10**9
        with pytest.raises(ValueError, match=r"token 1: position .* and slot 1000000000 below"):
            with torch.inference_mode():
                runner.model(inp.input_ids, inp.positions, inp.meta, runner.kv_cache.layers)
        assert runner.model._c_layer_table[1] is not None  # the C call ran first
    finally:
        runner.close()


def test_a_step_whose_projection_c_would_not_take_runs_the_python_loop(tmp_path):
    """int8 rows past the GEMV's on a depth the AMX tiles do not take (intermediate 136: 34
    groups of 4, not whole tiles) are dequantised for BLAS by LowpWeight: the one C call
    declines that step before touching anything, and the loop gives the same floats it
    gives without the table (before, the C call failed the step)."""
    tiny_hf_model("llama", str(tmp_path), seed=3, intermediate_size=136, num_key_value_heads=2)
    c_logits, c_out = generate(str(tmp_path), "int8", use_table=True)
    py_logits, py_out = generate(str(tmp_path), "int8", use_table=False)
    assert c_out == py_out
    for a, b in zip(c_logits, py_logits, strict=True):
        assert torch.equal(a, b)
