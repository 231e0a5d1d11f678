"""Model config parsing (clear errors for what we do not implement), checkpoint loading, the
`pipeline make-model` writer (transformers loads what it writes, and agrees with us) and the
checkpoint tokenizer wrapper."""
from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from model_driver import make_runner, tiny_hf_model

from pipeline.cli import main as cli_main
from pipeline.config import DEFAULT_MODEL
from pipeline.models.config import UnsupportedModelError, parse_model_config, rope_inv_freq
from pipeline.tokenizer.tokenizer import Tokenizer

BASE = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 256, "max_position_embeddings": 512}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.mark.parametrize("override, field", [
    ({"architectures": ["GPT2LMHeadModel"]}, "architecture 'GPT2LMHeadModel'"),
    ({"architectures": []}, "architecture None"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn'"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "'dynamic'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    ({"architectures": ["MistralForCausalLM"], "attention_bias": True}, "attention_bias"),
    ({"architectures": ["Qwen2ForCausalLM"], "mlp_bias": True}, "mlp_bias"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ({"hidden_size": None}, "'hidden_size'"),
])
def test_unsupported_configs_name_the_field(override, field):
    with pytest.raises(UnsupportedModelError, match=field.replace("(", r"\(").replace("[", r"\[")):
        parse_model_config({**BASE, **override})


def test_sliding_window_only_refused_when_in_effect():
    mistral = parse_model_config({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 128})
    mistral.check_max_model_len(128)
    with pytest.raises(UnsupportedModelError, match="sliding_window=128"):
        mistral.check_max_model_len(129)
    qwen_off = parse_model_config({**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 64,
                                   "use_sliding_window": False})
    assert qwen_off.sliding_window is None
    qwen_on = parse_model_config({**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 64,
                                  "use_sliding_window": True, "layer_types": ["full_attention", "sliding_attention"]})
    assert qwen_on.sliding_window == 64


def test_config_fields_and_eos_sources():
    c = parse_model_config({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 40,
                            "rope_theta": 5e5, "eos_token_id": 7, "tie_word_embeddings": True},
                           {"eos_token_id": [7, 9]})
    assert (c.head_dim, c.qk_norm, c.qkv_bias, c.rope.theta, c.eos_token_ids) == (40, True, False, 5e5, [7, 9])
    q2 = parse_model_config({**BASE, "architectures": ["Qwen2ForCausalLM"], "eos_token_id": 3})
    assert (q2.qkv_bias, q2.o_bias, q2.eos_token_ids, q2.head_dim) == (True, False, [3], 16)


def test_llama3_rope_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    hf_cfg = LlamaConfig(**{k: v for k, v in BASE.items() if k != "architectures"},
                         rope_scaling=scaling, rope_theta=5e5)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    ours = rope_inv_freq(parse_model_config({**BASE, "rope_scaling": scaling, "rope_theta": 5e5}).rope, 16)
    assert torch.allclose(ours, ref)


def test_loader_errors_name_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file
    tiny_hf_model("llama", str(tmp_path))
    sd = load_file(str(tmp_path / "model.safetensors"))
    bad = dict(sd)
    del bad["model.layers.1.mlp.up_proj.weight"]
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="layers.1.gate_up_weight"):
        make_runner(str(tmp_path))
    bad = dict(sd)
    bad["model.norm.weight"] = torch.ones(65)
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"norm.weight.*\(65,\)"):
        make_runner(str(tmp_path))
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        make_runner(str(tmp_path))


@pytest.mark.parametrize("arch, extra", [("llama", ["--max-shard-size", "200000"]),
                                         ("qwen2", ["--tie-word-embeddings"]),
                                         ("qwen3", ["--head-dim", "24", "--tokenizer", "bpe"])])
def test_make_model_is_a_transformers_checkpoint(tmp_path, arch, extra):
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    out = tmp_path / arch
    rc = cli_main(["make-model", "--arch", arch, "--out", str(out), "--hidden-size", "64",
                   "--intermediate-size", "96", "--num-layers", "2", "--num-heads", "4",
                   "--num-kv-heads", "2", "--vocab-size", "2304", "--tokenizer-vocab-size", "300", *extra])
    assert rc == 0
    files = set(os.listdir(out))
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= files
    if "--max-shard-size" in extra:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(hf).__name__ == json.loads((out / "config.json").read_text())["architectures"][0]
    # The generic fast tokenizer: AutoTokenizer would swap in a model-type class (Qwen2Tokenizer)
    # that rebuilds the pre-tokenizer instead of honouring tokenizer.json.
    hf_tok = PreTrainedTokenizerFast.from_pretrained(str(out))
    ours_tok = Tokenizer(out)
    text = "def f(x):\n    return x + 1  # comment"
    ids = ours_tok.encode(text)
    assert ids == hf_tok(text)["input_ids"]
    assert ours_tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    msgs = [{"role": "user", "content": "hello"}]
    assert ours_tok.apply_chat_template(msgs) == list(hf_tok.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
    runner = make_runner(str(out), max_model_len=512)
    try:
        prompt = ids[:12]
        from pipeline.messages import NewRequestData, SchedulerOutput, ids_to_bytes
        from pipeline.sampling_params import SamplingParams
        so = SchedulerOutput(1, [NewRequestData("a", ids_to_bytes(prompt), len(prompt),
                                                SamplingParams(temperature=0.0), [0], 0)],
                             [], {"a": len(prompt)}, len(prompt), [], [])
        runner._apply_diff(so)
        inp = runner.prepare_inputs(so)
        with torch.inference_mode():
            ours = runner.model.compute_logits(
                runner.model(inp.input_ids, inp.positions, inp.meta, runner.kv_cache.layers))
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        assert (ours - ref).abs().max().item() < 1e-4
        assert runner.eos_token_ids == ours_tok.eos_token_ids
    finally:
        runner.close()


# ---- the checkpoint tokenizer's chat rendering ------------------------------------------------
@pytest.fixture(scope="module")
def tokenizers():
    from transformers import PreTrainedTokenizerFast
    return Tokenizer(DEFAULT_MODEL), PreTrainedTokenizerFast.from_pretrained(DEFAULT_MODEL)


@pytest.mark.parametrize("msgs, error", [
    ([{"role": "robot", "content": "hi"}],
     r"field `messages\[0\]\.role`: must be one of system, user, assistant, tool, got 'robot'"),
    ([{"role": "user", "content": "a"}, {"content": "b"}], r"field `messages\[1\]\.role`: .* got 'None'"),
    (["hello"], r"field `messages\[0\]`: must be an object"),
    ([], r"field `messages`: at least one message"),
    ([{"role": "user", "content": 5}], r"field `messages\[0\]\.content`: must be a string or a list of text"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     r"field `messages\[0\]\.content\[0\]`: .*no multi-modal input.*'image_url'"),
])
def test_chat_messages_are_checked_naming_the_field(tokenizers, msgs, error):
    with pytest.raises(ValueError, match=error):
        tokenizers[0].apply_chat_template(msgs)


def test_chat_text_parts_tool_role_and_custom_template(tokenizers):
    tok = tokenizers[0]
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
             {"role": "tool", "content": "42"}]
    assert tok.render_chat(parts, False) == "<|bos|>user: a\nb\n\ntool: 42\n\n"
    custom = "{% for m in messages %}[{{ m['role'] }}|{{ m['content'] }}|{{ flavour }}]{% endfor %}"
    assert tok.render_chat(parts, chat_template=custom, flavour="x") == "[user|a\nb|x][tool|42|x]"
    with pytest.raises(ValueError, match="add_generation_prompt and continue_final_message"):
        tok.render_chat(parts, True, continue_final_message=True)
    with pytest.raises(ValueError, match=r"messages\[1\]\.content`: continue_final_message"):
        tok.render_chat([parts[0], {"role": "assistant", "content": " "}], False, continue_final_message=True)


@settings(max_examples=60, deadline=None)
@given(conv=st.lists(st.tuples(st.sampled_from(["system", "user", "assistant", "tool"]),
                               st.text(max_size=12).filter(str.strip)), min_size=1, max_size=4),
       continue_final=st.booleans())
@example(conv=[("system", "\r0\r")], continue_final=True)  # trailing whitespace the template keeps (CI)
def test_chat_ids_match_transformers(tokenizers, conv, continue_final):
    # Our rendering (roles, generation prompt, continuing the final message) gives the token
    # ids transformers' apply_chat_template gives on the same checkpoint.
    ours, hf = tokenizers
    msgs = [{"role": r, "content": c} for r, c in conv]
    want = hf.apply_chat_template(msgs, tokenize=True, return_dict=False,
                                  add_generation_prompt=not continue_final,
                                  continue_final_message=continue_final)
    got = ours.apply_chat_template(msgs, not continue_final, continue_final_message=continue_final)
    assert got == list(want)
