"""``LLM(...)``'s arguments that vLLM takes and this engine has no field for: accepted, with
their meaning here or a one-line warning naming what is ignored and why, so that a vLLM
script runs unchanged; and vLLM's ``generate`` arguments of older releases
(``prompt_token_ids=``) and of features not built (``lora_request``). Owns no state.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

# vLLM's LLM arguments with no engine field here; popped from **engine_args by ``take``.
ACCEPTED = ("tokenizer", "trust_remote_code", "swap_space", "disable_log_stats", "task", "runner")
# task= / runner=: every model here both generates and embeds (LLM.embed), so these say nothing.
TASKS = {"task": ("auto", "generate", "embed"), "runner": ("auto", "generate", "pooling")}


def _warn(text: str) -> None:
    warnings.warn(text, UserWarning, stacklevel=4)  # at the caller's LLM(...) line


def take(model: str, engine_args: dict[str, Any]) -> Path:
    """Pop ACCEPTED from ``engine_args`` (warning for those without effect here); the
    directory the tokenizer is read from (``tokenizer=``, else the model's)."""
    tokenizer = engine_args.pop("tokenizer", None)
    if engine_args.pop("trust_remote_code", False):
        _warn("LLM(trust_remote_code=True) ignored: only the built-in architectures run, never "
              "a checkpoint's own code")
    swap = engine_args.pop("swap_space", None)
    if swap:
        _warn(f"LLM(swap_space={swap}) ignored: a preempted request is recomputed, not swapped "
              "to CPU memory (a second KV tier is kv_offload_dir=)")
    # disable_log_stats: LLM logs no stats either way (stats() returns them), nothing to warn.
    engine_args.pop("disable_log_stats", None)
    for name, choices in TASKS.items():
        v = engine_args.pop(name, "auto")
        if v not in choices:
            raise ValueError(f"LLM({name}={v!r}): one of {', '.join(choices)} (every model here "
                             "generates and embeds)")
    return tokenizer_dir(model, tokenizer)


def tokenizer_dir(model: str, tokenizer: Any) -> Path:
    """``tokenizer=``: the model directory, or another directory with its tokenizer files
    (tokenizer.json); ValueError otherwise (a Hub name cannot be fetched: no network)."""
    if tokenizer is None:
        return Path(model)
    d = Path(tokenizer)
    if d.resolve() == Path(model).resolve():
        return d
    if not (d / "tokenizer.json").is_file():
        raise ValueError(f"tokenizer={str(tokenizer)!r}: not the model directory nor a directory "
                         "with a tokenizer.json (only local fast tokenizers are read)")
    return d


def prompts_of(prompts: Any, prompt_token_ids: Any) -> Any:
    """``generate``'s prompts, from ``prompts`` or vLLM's older ``prompt_token_ids=`` (one
    list of ids or a list of them), not both."""
    if prompt_token_ids is None:
        if prompts is None:
            raise TypeError("generate() needs prompts (or prompt_token_ids=)")
        return prompts
    if prompts is not None:
        raise TypeError("generate(): give prompts or prompt_token_ids=, not both")
    ids = list(prompt_token_ids)
    if ids and not isinstance(ids[0], (list, tuple)):
        ids = [ids]  # one prompt
    return [{"prompt_token_ids": list(p)} for p in ids]


def check_lora(lora_request: Any) -> None:
    """``lora_request=None`` is accepted; a LoRA adapter is refused (none can be loaded)."""
    if lora_request is not None:
        raise ValueError("lora_request: LoRA adapters are not supported (the base model only); "
                         "pass lora_request=None")
