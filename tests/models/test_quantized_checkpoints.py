"""GPTQ and AWQ 4-bit checkpoints (models/quantized.py): written by tests/quant_checkpoints.py
from tiny Llama and Qwen2 (q/k/v biases) models, loaded by the worker as int4. Every
projection holds exactly the checkpoint's weights (its dequantised copy equals the float
checkpoint of them, bit for bit), a prefill (the dequantise + GEMM path) gives the float32
model's hidden states within float rounding, decode (the GEMV, x quantised per token) stays
close; and what is not supported is refused naming the config field."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_driver import Driver, make_runner, tiny_hf_model
from quant_checkpoints import write_quantised

from pipeline.layers import ops
from pipeline.layers.int4 import Int4Weight
from pipeline.models.quantized import checkpoint_quantization, weight_format

pytestmark = pytest.mark.skipif(ops.backend(torch.device("cpu")) is None, reason="C CPU ops not built")
PROJ = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")
CASES = [("llama", "gptq", 32, True, False), ("llama", "gptq", 128, False, True),
         ("qwen2", "gptq", 32, False, True), ("qwen2", "gptq", 128, True, False),
         ("llama", "gptq_v2", 64, False, True),
         ("llama", "awq", 32, False, False), ("qwen2", "awq", 128, False, False)]


@pytest.fixture(scope="module")
def float_models(tmp_path_factory):
    out = {}
    for arch in ("llama", "qwen2"):
        path = str(tmp_path_factory.mktemp(f"float-{arch}"))
        tiny_hf_model(arch, path, seed=3, hidden_size=128, intermediate_size=256,
                      num_attention_heads=4, num_key_value_heads=2)
        out[arch] = path
    return out


def _hidden(model_dir: str, prompts: list[list[int]], share_from=None, max_tokens: int = 1):
    """The final hidden states compute_logits gets, per step (and the runner's model)."""
    runner = make_runner(model_dir, worker_threads=1)
    model = runner.model
    if share_from is not None:  # the same (int4) embedding and lm_head as the checkpoint run
        for name in ("embed_tokens", "lm_head"):
            delattr(model, name)
            setattr(model, name, getattr(share_from, name))
    seen: list[torch.Tensor] = []
    compute = model.compute_logits
    model.compute_logits = lambda h: (seen.append(h.clone()), compute(h))[1]
    try:
        d = Driver(runner)
        for i, p in enumerate(prompts):
            d.add(f"r{i}", p, max_tokens)
        out = d.run()
        return seen, out, model
    finally:
        runner.close()


@pytest.mark.parametrize("arch,method,gs,sym,act_order", CASES)
def test_checkpoint_loads_its_exact_weights(float_models, tmp_path, monkeypatch, request, arch, method, gs,
                                            sym, act_order):
    # float32 GEMMs for the batched path (a CPU with native bf16 would dequantise to bf16)
    monkeypatch.setattr("pipeline.worker.device.cpu_has_fast_bf16", lambda: False)  # weight_plan looks it up there
    cpu = ops.backend(torch.device("cpu"))
    if cpu is not None:  # the 80-row prefill below on the dequantised GEMM (AVX2 alone: the GEMV)
        cpu.set_isa("portable")
        request.addfinalizer(lambda: cpu.set_isa("amx"))
    qdir, rdir = str(tmp_path / "q"), str(tmp_path / "ref")
    write_quantised(float_models[arch], qdir, rdir, method, gs, sym, act_order)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (40,), generator=g).tolist() for _ in range(2)]
    q_hidden, q_out, q_model = _hidden(qdir, prompts, max_tokens=4)
    ref_hidden, ref_out, ref_model = _hidden(rdir, prompts, share_from=q_model, max_tokens=4)
    from safetensors.torch import load_file
    ref_w = load_file(str(Path(rdir) / "model.safetensors"))
    layer = q_model.layers[1]
    for name in PROJ:
        w = getattr(layer, name)
        assert isinstance(w, Int4Weight)
        assert (w.perm is not None) == (act_order and w.in_features > gs) and (w.zero is None) == sym
    parts = {"qkv_weight": ("self_attn", ("q_proj", "k_proj", "v_proj")), "o_weight": ("self_attn", ("o_proj",)),
             "gate_up_weight": ("mlp", ("gate_proj", "up_proj")), "down_weight": ("mlp", ("down_proj",))}
    for name, (mod, projs) in parts.items():
        want = torch.cat([ref_w[f"model.layers.1.{mod}.{p}.weight"].float() for p in projs])
        assert torch.equal(getattr(layer, name).dense(torch.float32), want)
    # The prefill step (80 rows: dequantise + GEMM) against float32 on the same weights.
    assert torch.allclose(q_hidden[0], ref_hidden[0], rtol=1e-4, atol=1e-4)
    # The first decode step (the GEMV, x quantised per token) of every sequence whose first
    # token agrees (a random model has near-ties): close, not equal.
    same = [i for i in range(len(prompts)) if q_out[f"r{i}"][0] == ref_out[f"r{i}"][0]]
    assert same
    a, b = q_hidden[1][same], ref_hidden[1][same]
    assert (a - b).norm() <= 0.05 * b.norm()


def _config(tmp_path, qc) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qc}))
    return str(tmp_path)


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, r"quantization_config.bits = 8"),
    ({"quant_method": "bitsandbytes"}, r"quantization_config.quant_method 'bitsandbytes'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, r"quantization_config.version"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 100}, r"quantization_config.group_size = 100"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     r"quantization_config.checkpoint_format"),
])
def test_unsupported_configs_are_refused_naming_the_field(tmp_path, qc, match):
    with pytest.raises(ValueError, match=match):
        checkpoint_quantization(_config(tmp_path, qc))


def test_int8_or_gpu_with_a_quantised_checkpoint_is_refused():
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    assert weight_format(qc, "none") == weight_format(qc, "int4") == "int4"
    assert weight_format(None, "int8") is None
    with pytest.raises(ValueError, match="--quantization int8: the checkpoint is already quantised"):
        weight_format(qc, "int8")
    with pytest.raises(ValueError, match="runs on CPU only"):
        weight_format(qc, "none", "cuda")
