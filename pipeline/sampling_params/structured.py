"""Sampling params: ``StructuredOutputsParams``, the grammar a request's output must follow
(vLLM's names), checked when built. Owns no state; ``structured_outputs.py`` compiles it.
"""
from __future__ import annotations

import msgspec

from pipeline.sampling_params.limits import bad, check_strings, json_depth, trusted

# structured_outputs: the spec (a schema, regex, grammar or the choices) in UTF-8 bytes, and
# the choices' count. The grammar compiles once, in the tokenizer stage under a time budget
# (structured_outputs.py), and travels with the request through every ring.
MAX_STRUCTURED_BYTES = 64 << 10
MAX_CHOICES = 256
MAX_MARKER_BYTES = 64  # reasoning_end
# A JSON schema's nesting (objects and arrays): xgrammar's compile time grows faster than
# linearly with it (measured: 129 levels 0.07 s, ~900 over 100 s), which the compile budget
# would refuse anyway; 64 levels (~30 nested objects) compile in ~20 ms.
MAX_SCHEMA_DEPTH = 64
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")



class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """vLLM's names: exactly one of ``json`` (a JSON schema, as an object or its text),
    ``regex``, ``choice``, ``grammar`` (EBNF, xgrammar's dialect of GBNF) or
    ``json_object=True`` (any JSON object)."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # Ours (a front end sets it for a reasoning model's answer: response_format, a forced tool
    # choice): the grammar starts after this text (``</think>``), which the model writes
    # freely before it; dropped by ``after_prompt`` when the prompt already closed it.
    reasoning_end: str | None = None

    def __post_init__(self) -> None:
        if trusted():
            return
        if self.reasoning_end is not None and not (
                isinstance(self.reasoning_end, str) and 0 < len(self.reasoning_end.encode()) <= MAX_MARKER_BYTES):
            raise bad("structured_outputs.reasoning_end", f"a string of 1 to {MAX_MARKER_BYTES} UTF-8 bytes",
                      self.reasoning_end)
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise bad("structured_outputs", f"exactly one of {', '.join(STRUCTURED_KINDS)}",
                       given or None)
        kind = given[0]
        if kind == "json_object" and self.json_object is not True:
            raise bad("structured_outputs.json_object", "true", self.json_object)
        if kind == "choice":
            assert self.choice is not None
            if not isinstance(self.choice, list) or not self.choice:
                raise bad("structured_outputs.choice", "a non-empty list of strings", self.choice)
            check_strings("structured_outputs.choice", self.choice, MAX_CHOICES, MAX_STRUCTURED_BYTES)
        size = len(self.spec_text().encode("utf-8", "surrogatepass"))
        if size > MAX_STRUCTURED_BYTES:
            raise bad(f"structured_outputs.{kind}", f"at most {MAX_STRUCTURED_BYTES} UTF-8 bytes",
                       f"{size} bytes")
        if kind in ("regex", "grammar", "json") and not self.spec_text().strip():
            raise bad(f"structured_outputs.{kind}", "non-empty", getattr(self, kind))
        if kind == "json":
            depth = json_depth(self.json)
            if depth > MAX_SCHEMA_DEPTH:
                raise bad("structured_outputs.json", f"nested at most {MAX_SCHEMA_DEPTH} levels "
                           f"deep (objects and arrays)", f"{depth} levels")

    def after_prompt(self, prompt_tail: str) -> StructuredOutputsParams:
        """This spec for a prompt ending in ``prompt_tail``: without ``reasoning_end`` when the
        prompt already closed the reasoning (a template that turned thinking off writes an
        empty ``<think></think>`` there), so the grammar applies from the first token."""
        if self.reasoning_end is not None and prompt_tail.rstrip().endswith(self.reasoning_end):
            return msgspec.structs.replace(self, reasoning_end=None)
        return self

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    def spec_text(self) -> str:
        """The spec as one string (a schema object as JSON with sorted keys; choices as a JSON
        array): what identifies it, with ``kind`` (the grammar compiles from the schema as
        given, whose key order the output follows)."""
        import json as _json
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json_object":
            return ""
        if kind == "choice" or isinstance(value, dict):
            return _json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        return str(value)
