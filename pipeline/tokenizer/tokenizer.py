"""Tokenizer of a Hugging Face checkpoint directory, used by the tokenizer stage (text and chat
messages -> token ids) and the token processor (eos ids, special tokens).

Owns the loaded ``tokenizers.Tokenizer`` and the chat template; compiled templates (the
model's, or one a caller passes) are kept in a small process-wide cache. Reads tokenizer.json,
tokenizer_config.json (special tokens, add_bos_token, chat_template), chat_template.jinja when
present, and generation_config.json / config.json for the eos ids; a template given to the
constructor (``--chat-template``) replaces the checkpoint's. Chat messages and chat options
are checked here, for every way in: roles (system, user, assistant, tool), content (a string,
or a list of text parts as OpenAI sends them), add_generation_prompt / continue_final_message
/ chat_template_kwargs, each error naming the message and the field.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

from tokenizers import Tokenizer as HFTokenizer

from pipeline.sampling_params import SamplingParams

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


CHAT_ROLES = ("system", "user", "assistant", "tool")
# Template variables that come from the chat itself or pick the template: never a kwarg's.
RESERVED_TEMPLATE_VARS = ("messages", "add_generation_prompt", "continue_final_message",
                          "chat_template", "tools")


def check_chat_options(*, has_messages: bool, add_generation_prompt: bool,
                       continue_final_message: bool,
                       chat_template_kwargs: dict[str, Any] | None,
                       tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A request's chat options (defaults: True, False, None) as apply_chat_template's keyword
    arguments; ValueError naming the field when they are set without ``messages`` or collide."""
    if not has_messages:
        for name, is_set in (("add_generation_prompt", not add_generation_prompt),
                             ("continue_final_message", continue_final_message),
                             ("chat_template_kwargs", chat_template_kwargs is not None),
                             ("tools", tools is not None)):
            if is_set:
                raise ValueError(f"field `{name}`: only valid with `messages` (a chat request)")
    kwargs = dict(chat_template_kwargs or {})
    for key in kwargs:
        if not isinstance(key, str):
            raise ValueError(f"field `chat_template_kwargs`: keys must be strings, got {type(key).__name__}")
        if key in RESERVED_TEMPLATE_VARS:
            raise ValueError(f"field `chat_template_kwargs`: `{key}` cannot be set here (it comes "
                             "from the request itself)")
    if tools is not None:
        kwargs["tools"] = check_tools(tools)
    return kwargs | {"continue_final_message": continue_final_message}


def check_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """OpenAI's ``tools``: each ``{"type": "function", "function": {"name": ..., ...}}``;
    ValueError naming the tool. None for an empty list (a template tests ``tools`` for
    truthiness, as transformers passes None)."""
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ValueError(f"field `tools[{i}]`: must be {{\"type\": \"function\", \"function\": {{...}}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"field `tools[{i}].function.name`: a non-empty string is required")
        if not isinstance(fn.get("parameters", {}), dict):
            raise ValueError(f"field `tools[{i}].function.parameters`: must be a JSON schema object")
    return tools or None


@lru_cache(maxsize=8)
def _compile(source: str) -> Template:
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda v, indent=None, **_: json.dumps(v, indent=indent, ensure_ascii=False)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _content(i: int, m: dict) -> str | None:
    """A message's content as the template sees it: a string (text parts joined by newlines,
    as vLLM does for string-content templates); None only for an assistant's tool calls."""
    content = m.get("content")
    if isinstance(content, str):
        return content
    if content is None and m.get("role") == "assistant" and m.get("tool_calls"):
        return None
    if not isinstance(content, list):
        raise ValueError(f"field `messages[{i}].content`: must be a string or a list of text parts, "
                         f"got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"field `messages[{i}].content[{j}]`: only {{\"type\": \"text\", \"text\": ...}} "
                             f"parts are supported (no multi-modal input), got type {str(kind)[:64]!r}")
        texts.append(part["text"])
    return "\n".join(texts)


def check_messages(messages: list[dict]) -> list[dict]:
    """The messages with a known role each and string content; ValueError naming the field."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("field `messages`: at least one message is required")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"field `messages[{i}]`: must be an object with `role` and `content`, "
                             f"got {type(m).__name__}")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(f"field `messages[{i}].role`: must be one of {', '.join(CHAT_ROLES)}, "
                             f"got {str(role)[:64]!r}")
        out.append({**m, "content": _content(i, m)})
    return out


class Tokenizer:
    def __init__(self, model_dir: str | Path, chat_template: str | None = None) -> None:
        """``chat_template``: template text that replaces the checkpoint's (``--chat-template``)."""
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
        self.chat_template = chat_template if chat_template is not None else self._template_source(d)

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
        # encode_batch releases the GIL (encode does not): the tokenizer stage tokenizes a long
        # prompt on a pool thread while its loop keeps serving small ones.
        ids = self.tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        # Some checkpoints ask for BOS in tokenizer_config without a post-processor doing it.
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, *,
                    continue_final_message: bool = False, chat_template: str | None = None,
                    **extra: Any) -> str:
        """The conversation as text, like transformers' ``apply_chat_template(tokenize=False)``.

        ``continue_final_message``: end the text right after the last message's content, so
        the model continues it (no end-of-turn marker); ``chat_template`` replaces the model's."""
        source = chat_template if chat_template is not None else self.chat_template
        if source is None:
            raise ValueError("field `messages`: this model has no chat template "
                             "(tokenizer_config.json chat_template); send `prompt` instead")
        if add_generation_prompt and continue_final_message:
            raise ValueError("field `continue_final_message`: add_generation_prompt and "
                             "continue_final_message cannot both be true: the first starts a new "
                             "assistant turn, the second continues the last one")
        for key in ("messages", "add_generation_prompt"):
            if key in extra:
                raise ValueError(f"field `chat_template_kwargs`: chat template variable `{key}` "
                                 "comes from the chat itself")
        messages = check_messages(messages)
        variables = {k: _token_str(self.config.get(k)) or "" for k in
                     ("bos_token", "eos_token", "pad_token", "unk_token")} | extra
        from jinja2 import TemplateError
        try:
            text = _compile(source).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                           **variables)
        except TemplateError as exc:  # e.g. a chat_template_kwargs value the template cannot use
            raise ValueError(f"chat template: {type(exc).__name__}: {exc}") from None
        if continue_final_message:
            # As transformers does: cut right after the last occurrence of the final content,
            # keeping its trailing spaces only where the template kept them.
            final = messages[-1]["content"] or ""
            at = text.rfind(final.strip()) if final.strip() else -1
            if at < 0:
                raise ValueError(f"field `messages[{len(messages) - 1}].content`: continue_final_message "
                                 "needs non-empty content that the chat template renders")
            n = len(final.lstrip())  # the content's trailing whitespace kept where the template kept it
            text = text[:at + (n if text[at:at + n] == final.lstrip() else len(final.strip()))]
        return text

    @property
    def eos_token_id(self) -> int | None:
        """As Hugging Face's: the id of tokenizer_config's eos_token (else the checkpoint's first)."""
        eos = self.tok.token_to_id(self.eos_token) if self.eos_token else None
        return eos if eos is not None else next(iter(self.eos_token_ids), None)

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> dict[str, Any]:
        """As a Hugging Face tokenizer called on text: ``{"input_ids": [...], "attention_mask":
        [...]}`` (lists of lists for a list of texts)."""
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens)
            return {"input_ids": ids, "attention_mask": [1] * len(ids)}
        batch = [self.encode(t, add_special_tokens) for t in text]
        return {"input_ids": batch, "attention_mask": [[1] * len(ids) for ids in batch]}

    @overload
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            tokenize: Literal[True] = True, **options: Any) -> list[int]: ...

    @overload
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            tokenize: Literal[False], **options: Any) -> str: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            tokenize: bool = True, **options: Any) -> list[int] | str:
        """Token ids of the rendered conversation (``render_chat``'s options; the template
        already places BOS), or its text with ``tokenize=False``, as transformers' (``tokenize``
        is this call's, never a template variable)."""
        text = self.render_chat(messages, add_generation_prompt, **options)
        if not tokenize:
            return text
        return self.tok.encode_batch([text], add_special_tokens=False)[0].ids


def settle_reasoning(sp: SamplingParams, prompt_ids: list[int], tok: Tokenizer | None) -> SamplingParams:
    """``sp`` with its grammar's ``reasoning_end`` dropped when the prompt already closed the
    reasoning (``StructuredOutputsParams.after_prompt``): read from the prompt's last tokens."""
    so = sp.structured_outputs
    if so is None or so.reasoning_end is None or tok is None:
        return sp
    import msgspec
    tail = tok.decode(prompt_ids[-REASONING_TAIL_TOKENS:], skip_special_tokens=False)
    return msgspec.structs.replace(sp, structured_outputs=so.after_prompt(tail))


REASONING_TAIL_TOKENS = 32  # enough for "</think>" and the whitespace after it


def max_token_text_bytes(tok: HFTokenizer) -> int:
    """The most text (UTF-8 bytes) one token can add to an answer. A token whose own text is
    valid UTF-8 adds its bytes, plus one for the leading space a Metaspace / Strip decoder
    drops from a text's first token; one that decodes to U+FFFD (part of a character) adds at
    most 3 bytes (one U+FFFD) per byte it holds."""
    size = tok.get_vocab_size(with_added_tokens=True)
    most = 0
    for text in tok.decode_batch([[i] for i in range(size)], skip_special_tokens=False):
        n = len(text.encode("utf-8", "surrogatepass"))
        most = max(most, 3 * n if "\ufffd" in text else n + 1)
    return most
