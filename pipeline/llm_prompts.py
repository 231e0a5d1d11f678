"""The in-process ``LLM``'s prompts: a string, a list of token ids, a vLLM prompt dict or a
request dict of pipe mode / ZMQ (read by the protocol's own parser, so one request dict works
on every path), chat conversations rendered with the tokenizer's template, each checked by
the one request validator (``tokenizer.validate``) into a ``Prompt`` ready to queue.

Owns / State: the request-id counter of its LLM (``llm-N``).
"""
from __future__ import annotations

import itertools
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from pipeline.sampling_params import SamplingParams
from pipeline.tokenizer.tokenizer import settle_reasoning
from pipeline.tokenizer.validate import InvalidRequest, check_prompt_text, one_prompt_field, prepare_request

if TYPE_CHECKING:
    from pipeline.tokenizer.tokenizer import Tokenizer

MULTI_MODAL_FIELDS = ("multi_modal_data", "mm_processor_kwargs")


@dataclass(slots=True)
class Prompt:
    """A validated prompt of one generate/chat call, before it is queued."""
    request_id: str  # the caller's (a request dict's "id") or ours; the engine uses `rid`
    rid: str
    text: str | None
    token_ids: list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    embed: bool = False  # LLM.embed's: pooled, not generated


class PromptReader:
    def __init__(self, tokenizer: Tokenizer | None, worker: Any, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.worker = worker  # its vocab size and grammar support (``structured``)
        self.max_model_len = max_model_len
        self._ids = itertools.count()

    def read(self, p: Any, sp: SamplingParams, priority: int, salt: str | None,
             embed: bool = False) -> Prompt:
        if isinstance(p, str):
            check_prompt_text(p)
            return self.make(p, self.encode(p), "prompt", sp, priority, salt, None, embed)
        if isinstance(p, dict):
            return self._from_dict(p, sp, priority, salt, embed)
        if isinstance(p, Sequence):
            ids = []
            for j, t in enumerate(p):
                if not is_token_id(t):
                    raise InvalidRequest(f"field `prompt_token_ids[{j}]`: token ids must be integers, "
                                         f"got {type(t).__name__}")
                ids.append(int(t))
            return self.make(None, ids, "prompt_token_ids", sp, priority, salt, None, embed)
        raise InvalidRequest(f"a prompt must be a string, a list of token ids or a dict, got {type(p).__name__}")

    def _from_dict(self, p: dict, sp: SamplingParams, priority: int, salt: str | None,
                   embed: bool = False) -> Prompt:
        """vLLM's prompt dicts and pipe mode's / ZMQ's request dicts, by the protocol's parser."""
        from pipeline.frontend.request_parser import request_from_json

        for key in MULTI_MODAL_FIELDS:
            if key in p:
                raise InvalidRequest(f"field `{key}`: multi-modal input is not supported "
                                     "(text-only models)")
        gen, sp = request_from_json(p, msgspec.structs.asdict(sp))
        field = one_prompt_field(prompt=gen.prompt, prompt_token_ids=gen.prompt_token_ids,
                                 messages=gen.messages)
        priority = gen.priority if "priority" in p else priority
        salt = salt if gen.cache_salt is None else gen.cache_salt
        rid = None if gen.id is None else str(gen.id)
        from pipeline.tokenizer.tokenizer import check_chat_options

        options = check_chat_options(has_messages=gen.messages is not None,
                                     add_generation_prompt=gen.add_generation_prompt,
                                     continue_final_message=gen.continue_final_message,
                                     chat_template_kwargs=gen.chat_template_kwargs)
        if gen.messages is not None:
            text, ids = self.render(msgspec.to_builtins(gen.messages), gen.add_generation_prompt,
                                     options)
        elif gen.prompt is not None:
            check_prompt_text(gen.prompt)
            text, ids = gen.prompt, self.encode(gen.prompt)
        else:
            text, ids = None, list(gen.prompt_token_ids or [])
        return self.make(text, ids, field, sp, priority, salt, rid, embed)

    def render(self, conv: list[dict], add_generation_prompt: bool,
                options: dict[str, Any]) -> tuple[str, list[int]]:
        tok = self.tokenizer
        if tok is None:
            raise ValueError("no tokenizer: skip_tokenizer_init=True was set")
        text = tok.render_chat(conv, add_generation_prompt, **options)
        return text, tok.encode(text, add_special_tokens=False)  # the template places BOS

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequest("text prompts need a tokenizer (skip_tokenizer_init=True was set)")
        return self.tokenizer.encode(text)

    def make(self, text: str | None, ids: list[int], field: str, sp: SamplingParams,
              priority: int, salt: str | None, request_id: str | None, embed: bool = False) -> Prompt:
        tok = self.tokenizer
        if tok is None and (sp.stop or sp.bad_words):
            raise InvalidRequest("stop strings and bad_words need a tokenizer "
                                 "(skip_tokenizer_init=True was set)")
        ids, sp = prepare_request(
            ids, sp, field=field, vocab_size=self.worker.vocab_size,
            max_model_len=self.max_model_len,
            encode=None if tok is None else lambda w: tok.encode(w, add_special_tokens=False),
            embed=embed)
        sp = settle_reasoning(sp, ids, tok)
        structured = getattr(self.worker, "structured", None)
        if sp.structured_outputs is not None:  # refused here, as the tokenizer stage refuses it
            if structured is None:
                raise InvalidRequest("structured_outputs: this worker has no grammar support")
            structured.validate(sp.structured_outputs)  # compiles into the worker's cache
        rid = f"llm-{next(self._ids)}"
        return Prompt(request_id or rid, rid, text, ids, sp, priority, salt, embed)


def is_token_id(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def per_prompt(sampling_params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params or SamplingParams()] * n
    values = list(sampling_params)
    if len(values) != n:
        raise InvalidRequest(f"sampling_params: got {len(values)} for {n} prompts")
    return values
