"""Checks of the committed default model (``pipeline/default_model``).

The checkpoint must be a Hugging Face LlamaForCausalLM directory that `make run` can serve
with no download: files, config, weight names and shapes, size limit, tokenizer, generation
config, and (where transformers is installed) logits identical to transformers'.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from tokenizers import Tokenizer

from pipeline.config import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = Path(DEFAULT_MODEL)
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "generation_config.json")
MAX_BYTES = 10_000_000
# Reference-manual prose: the kind of text the model was trained on.
KNOWN_TEXT = (
    'The "for" statement is used to iterate over the elements of a sequence\n'
    "(such as a string, tuple or list) or other iterable object:"
)


def _json(name: str) -> dict:
    return json.loads((MODEL_DIR / name).read_text())


def _trainer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_default_model", ROOT / "tools/train_default_model.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))


def test_files_present_and_small() -> None:
    assert MODEL_DIR.is_dir()
    names = {p.name for p in MODEL_DIR.iterdir() if not p.name.startswith(".")}
    assert set(FILES) <= names
    total = sum(p.stat().st_size for p in MODEL_DIR.iterdir() if p.is_file())
    assert total <= MAX_BYTES, f"default model is {total} bytes, limit {MAX_BYTES}"


def test_config_is_a_valid_gqa_llama() -> None:
    c = _json("config.json")
    assert c["architectures"] == ["LlamaForCausalLM"] and c["model_type"] == "llama"
    assert c["hidden_size"] == c["num_attention_heads"] * c["head_dim"]
    assert c["num_attention_heads"] % c["num_key_value_heads"] == 0
    assert c["num_key_value_heads"] < c["num_attention_heads"], "default model should exercise GQA"
    assert c["tie_word_embeddings"] is True and c["hidden_act"] == "silu"
    assert c["rope_scaling"] is None and c["rope_theta"] == 10000.0
    assert not c["attention_bias"] and not c["mlp_bias"]
    assert c["torch_dtype"] in ("bfloat16", "float32") and c["dtype"] == c["torch_dtype"]
    assert {c["bos_token_id"], c["eos_token_id"], c["pad_token_id"]} < set(range(c["vocab_size"]))


def test_weights_have_hf_names_and_shapes() -> None:
    c = _json("config.json")
    h, d, i = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    want = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,)}
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        want |= {
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
    with safe_open(str(MODEL_DIR / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        got = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert got == want  # tied embeddings: no lm_head.weight
    assert dtypes == {{"bfloat16": "BF16", "float32": "F32"}[c["torch_dtype"]]}


def test_special_tokens_agree_across_files(tok: Tokenizer) -> None:
    c, tc, g = _json("config.json"), _json("tokenizer_config.json"), _json("generation_config.json")
    assert tok.get_vocab_size() == c["vocab_size"]
    assert tc["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tok.token_to_id(tc["bos_token"]) == c["bos_token_id"] == g["bos_token_id"]
    assert tok.token_to_id(tc["eos_token"]) == c["eos_token_id"]
    assert tok.token_to_id(tc["pad_token"]) == c["pad_token_id"]
    eos = g["eos_token_id"]
    assert c["eos_token_id"] in (eos if isinstance(eos, list) else [eos])
    assert tok.encode("x").ids[0] == c["bos_token_id"], "encode(add_special_tokens) must prepend BOS"


def test_chat_template_renders() -> None:
    jinja2 = pytest.importorskip("jinja2", reason="jinja2 renders chat templates")
    tc = _json("tokenizer_config.json")
    out = jinja2.Environment().from_string(tc["chat_template"]).render(
        messages=[{"role": "user", "content": "What does the for statement do?"}],
        add_generation_prompt=True, bos_token=tc["bos_token"], eos_token=tc["eos_token"],
    )
    assert out.startswith(tc["bos_token"]) and "What does the for statement do?" in out


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200))
def test_tokenizer_round_trips_any_text(text: str) -> None:
    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_tokenizer_compresses_reference_text(tok: Tokenizer) -> None:
    ids = tok.encode(KNOWN_TEXT, add_special_tokens=False).ids
    assert len(ids) < len(KNOWN_TEXT) / 3, "BPE merges missing: fewer than 3 chars per token"


def test_checkpoint_is_trained(tok: Tokenizer) -> None:
    from pydoc_data.topics import topics

    model, _ = _trainer().load_checkpoint(MODEL_DIR)
    ids = torch.tensor([tok.encode(topics["for"][:2000]).ids])
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(model(ids[:, :-1])[0], ids[0, 1:]).item()
    # Uniform guessing is ln(2048) = 7.6 nats; 20 training steps reach about 6.3.
    assert loss < 4.5, f"loss {loss:.2f} on the reference manual: checkpoint looks untrained"


def test_transformers_logits_match_training_model(tok: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers checks the checkpoint format")
    model, _ = _trainer().load_checkpoint(MODEL_DIR)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode(KNOWN_TEXT * 3).ids])
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert (ours - theirs).abs().max().item() < 1e-3


def test_worker_serves_default_model_like_training_model(tok: Tokenizer) -> None:
    pytest.importorskip("pipeline.worker.model_runner", reason="worker model runner not importable")
    from model_driver import Driver, make_runner

    model, _ = _trainer().load_checkpoint(MODEL_DIR)
    prompt = tok.encode(KNOWN_TEXT).ids
    want = model.generate(prompt, 24, 0.0, eos=-1, gen=torch.Generator())
    runner = make_runner(str(MODEL_DIR), max_model_len=256)
    try:
        d = Driver(runner)
        d.add("r", prompt, len(want))
        assert d.run()["r"] == want
    finally:
        name = runner.kv_cache.shm_name
        runner.close()
    assert not Path("/dev/shm" + name).exists()
