"""Tokenizer of a Hugging Face checkpoint directory, used by the tokenizer stage (text and chat
messages -> token ids) and the token processor (eos ids, special tokens).

Owns the loaded ``tokenizers.Tokenizer`` and the compiled chat template. Reads
tokenizer.json, tokenizer_config.json (special tokens, add_bos_token, chat_template),
chat_template.jinja when present, and generation_config.json / config.json for the eos ids.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer as HFTokenizer

if TYPE_CHECKING:
    from jinja2 import Template


def _token_str(v: Any) -> str | None:
    # tokenizer_config writes special tokens either as strings or as AddedToken dicts.
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


def _ids(v: Any) -> list[int]:
    if v is None:
        return []
    return [int(v)] if isinstance(v, int) else [int(x) for x in v]


def _raise(message: str) -> None:
    raise ValueError(f"chat template: {message}")


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        d = Path(model_dir)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"--model {d}: no tokenizer.json (only `tokenizers` fast tokenizers are supported)")
        self.tok = HFTokenizer.from_file(str(path))
        cfg_path = d / "tokenizer_config.json"
        self.config: dict = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_str(self.config.get("bos_token"))
        self.eos_token = _token_str(self.config.get("eos_token"))
        self.pad_token = _token_str(self.config.get("pad_token"))
        self.bos_token_id = self.tok.token_to_id(self.bos_token) if self.bos_token else None
        self.add_bos = bool(self.config.get("add_bos_token", False)) and self.bos_token_id is not None
        self.eos_token_ids = self._eos_ids(d)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(i for i, t in self.tok.get_added_tokens_decoder().items()
                                     if t.special)
        self.chat_template = self._template_source(d)
        self._template: Template | None = None

    def _eos_ids(self, d: Path) -> list[int]:
        for name in ("generation_config.json", "config.json"):
            p = d / name
            if p.is_file():
                ids = _ids(json.loads(p.read_text()).get("eos_token_id"))
                if ids:
                    return ids
        eos = self.tok.token_to_id(self.eos_token) if self.eos_token else None
        return [] if eos is None else [eos]

    def _template_source(self, d: Path) -> str | None:
        jinja = d / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text()
        tpl = self.config.get("chat_template")
        if isinstance(tpl, list):  # named templates: use "default"
            named = {t.get("name"): t.get("template") for t in tpl}
            tpl = named.get("default") or next(iter(named.values()), None)
        return tpl

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=add_special_tokens).ids
        # Some checkpoints ask for BOS in tokenizer_config without a post-processor doing it.
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str:
        if self.chat_template is None:
            raise ValueError("field `messages`: this model has no chat template "
                             "(tokenizer_config.json chat_template); send `prompt` instead")
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda v, indent=None, **_: json.dumps(v, indent=indent, ensure_ascii=False)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        specials = {k: _token_str(self.config.get(k)) or "" for k in
                    ("bos_token", "eos_token", "pad_token", "unk_token")}
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **specials, **extra)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered conversation; the template already places BOS."""
        return self.tok.encode(self.render_chat(messages, add_generation_prompt),
                               add_special_tokens=False).ids
