"""Structured outputs: the grammar a request's output must match (``SamplingParams.
structured_outputs``), compiled by xgrammar against the model's tokenizer.

``Grammars`` holds one xgrammar compiler per tokenizer, whose cache is keyed by the spec, so
a spec compiles once per process; both the tokenizer stage (to refuse a bad spec before the
request reaches the engine) and the worker (rank 0, which masks and samples) use it. xgrammar
rather than our own automata: its compiled grammars precompute, per grammar state, which
tokens of the vocabulary can follow (the "adaptive token mask cache"), so filling a request's
bitmask costs microseconds, and vLLM, SGLang and FastDeploy build on it.

- ``json``: the schema, with no whitespace between tokens (``any_whitespace=False``): once
  the object closes only the stop tokens remain, so a complete answer ends the request
  (finish_reason ``stop``) instead of trailing spaces.
- ``json_object``: any JSON object, whitespace as for ``json``.
- ``regex``, ``grammar`` (EBNF), ``choice`` (an EBNF alternation of the quoted choices).

A compile can take minutes (``{"type":"string","pattern":"(([a-z]{1,12}){1,12}){1,12}"}``:
3.6-14 s on the default model) and cannot be interrupted in its thread, so the serving stages
never compile on a path anyone waits on: the tokenizer stage compiles each spec once in a
child process it kills past ``COMPILE_BUDGET_S`` (``tokenizer/grammar_server.py``) and the
compiled grammar travels with the request (``to_bytes``: xgrammar's serialized form, zlib'd);
the worker only loads it (``Grammars.load``, milliseconds). ``compiles`` counts this
process's compile calls (tests check the worker makes none for a request that arrived compiled).

Owns: the compilers (thread-safe; xgrammar compiles with its own threads and releases the GIL).
"""
from __future__ import annotations

import hashlib
import json
import re
import threading
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.sampling_params.structured import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

# Compiled grammars kept per compiler (bytes of xgrammar's cache).
CACHE_BYTES = 256 << 20
# Loaded (worker-side) grammars kept, in bytes of their compressed blobs.
LOADED_BYTES = 64 << 20
# The longest a spec may compile (seconds, in the tokenizer stage's compile process): specs
# users send compile in milliseconds (3-field schema: 52 ms at a 152k vocabulary), the
# issue-25 pattern in 3.6-14 s at 2048 tokens (longer on larger vocabularies).
COMPILE_BUDGET_S = 5.0
# zlib level of a compiled grammar on the rings: level 1 takes it to ~1/3 (a 3.7 MB regex
# grammar at 152k tokens: 1.25 MB in 24 ms, 10 ms to inflate); higher levels gain little.
ZLIB_LEVEL = 1


class GrammarError(ValueError):
    """A spec xgrammar cannot compile; the message names the field."""


def _import_xgrammar():
    try:
        import xgrammar
    except ImportError as exc:  # pragma: no cover - installed by `make setup`
        raise GrammarError("structured_outputs needs the xgrammar package (pip install "
                           "'pipeline[structured]' or xgrammar)") from exc
    return xgrammar


def tokenizer_info(tokenizer_json: Path, vocab_size: int, stop_token_ids: list[int]) -> xgrammar.TokenizerInfo:
    """xgrammar's view of a Hugging Face ``tokenizer.json``, with the model's vocabulary size
    (rows of the LM head, which may exceed the tokenizer's) and its stop tokens."""
    xgr = _import_xgrammar()
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer_json))
    vocab = tok.get_vocab(with_added_tokens=True)
    encoded = [""] * max(vocab_size, max(vocab.values()) + 1)
    for text, i in vocab.items():
        encoded[i] = text
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok.to_str())
    return xgr.TokenizerInfo(encoded[:vocab_size], xgr.VocabType(meta["vocab_type"]), vocab_size=vocab_size,
                             stop_token_ids=stop_token_ids, add_prefix_space=meta["add_prefix_space"])


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose sentences are exactly ``choices`` (JSON string escapes are xgrammar's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def text_until(marker: str) -> str:
    """A regex of any text that ends with its first ``marker`` (then optional whitespace),
    for a marker whose first character does not recur in it (``</think>``): the automaton
    that looks for the marker, written out (xgrammar's regexes have no look-ahead). From
    inside a partial marker, its first character starts over (``loop``); any other
    character that does not continue it leaves (``exits``)."""
    m0, rest = marker[0], marker[1:]
    if m0 in rest:
        raise ValueError(f"reasoning_end {marker!r}: its first character recurs in it")
    e = re.escape
    prefixes = [rest[:i] for i in range(len(rest))]
    loop = "(?:" + "|".join(e(p) + e(m0) for p in prefixes) + ")"
    exits = "(?:" + "|".join(e(p) + _not(rest[i], m0) for i, p in enumerate(prefixes)) + ")"
    return f"(?:{_not(m0)}|{e(m0)}{loop}*{exits})*{e(m0)}{loop}*{e(rest)}" + r"\s*"


def _not(*chars: str) -> str:
    return "[^" + "".join("\\" + c if c in "\\]^-[" else c for c in chars) + "]"


def spec_key(so: StructuredOutputsParams) -> bytes:
    """What identifies a compiled grammar: the spec as msgpack (a schema object keeps its key
    order, which the output follows)."""
    import msgspec
    return hashlib.sha256(msgspec.msgpack.encode(so)).digest()


def to_bytes(compiled: xgrammar.CompiledGrammar) -> bytes:
    """A compiled grammar as it travels to the worker (``Grammars.load`` reads it)."""
    return zlib.compress(compiled.serialize_json().encode(), ZLIB_LEVEL)


class Grammars:
    """Compiles ``StructuredOutputsParams`` for one model's tokenizer."""

    def __init__(self, model_dir: str | Path, vocab_size: int, stop_token_ids: list[int],
                 max_threads: int = 2) -> None:
        xgr = _import_xgrammar()
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise GrammarError(f"structured_outputs needs the model's tokenizer.json ({path} is missing)")
        self.info = tokenizer_info(path, vocab_size, stop_token_ids)
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads, cache_enabled=True,
                                             cache_limit_bytes=CACHE_BYTES)
        self._lock = threading.Lock()
        self.compiles = 0  # compile() calls (cache hits included): see the module docstring
        # Loaded grammars by spec (a repeated spec loads once, as it compiled once): loading
        # is ~10 ms per MB of blob; bounded by their blobs' bytes (about a third of theirs).
        self._loaded: OrderedDict[bytes, tuple[xgrammar.CompiledGrammar, int]] = OrderedDict()
        self._loaded_bytes = 0

    def load(self, blob: bytes, so: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        """The compiled grammar of ``so`` that ``to_bytes`` made (for this tokenizer)."""
        key = spec_key(so)
        with self._lock:
            hit = self._loaded.get(key)
            if hit is not None:
                self._loaded.move_to_end(key)
                return hit[0]
        xgr = _import_xgrammar()
        compiled = xgr.CompiledGrammar.deserialize_json(zlib.decompress(blob).decode(), self.info)
        with self._lock:
            if key not in self._loaded:
                self._loaded[key] = (compiled, len(blob))
                self._loaded_bytes += len(blob)
            while self._loaded_bytes > LOADED_BYTES and len(self._loaded) > 1:
                self._loaded_bytes -= self._loaded.popitem(last=False)[1][1]
        return compiled

    def compile(self, so: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        """The compiled grammar of ``so`` (from the cache when it compiled before);
        GrammarError naming the field when xgrammar refuses the spec."""
        kind = so.kind
        with self._lock:
            self.compiles += 1
        c = self._compiler
        try:
            if so.reasoning_end is not None:  # free text up to the marker, then the grammar
                xgr = _import_xgrammar()
                free = xgr.Grammar.from_regex(text_until(so.reasoning_end))
                return c.compile_grammar(xgr.Grammar.concat(free, self._grammar(so)))
            # Straight to the compiler's calls: they hit its cache by spec (~10 us for a
            # repeated schema, against ~0.7 ms to build a Grammar object first).
            if kind == "json":  # the schema's own key order: the output follows it
                return c.compile_json_schema(_schema_text(so), any_whitespace=False)
            if kind == "json_object":  # any object, without free whitespace (as above)
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                assert so.regex is not None
                return c.compile_regex(so.regex)
            return c.compile_grammar(_ebnf(so))
        except (RuntimeError, ValueError, TypeError) as exc:
            what = {"json": "JSON schema", "regex": "regex", "grammar": "EBNF grammar",
                    "choice": "choice list", "json_object": "JSON grammar"}[kind]
            raise GrammarError(f"structured_outputs.{kind}: not a valid {what}: "
                               f"{_clean(str(exc))}") from None

    @staticmethod
    def _grammar(so: StructuredOutputsParams) -> xgrammar.Grammar:
        """``so``'s grammar as an object (to concatenate)."""
        xgr = _import_xgrammar()
        if so.kind == "json":
            return xgr.Grammar.from_json_schema(_schema_text(so), any_whitespace=False)
        if so.kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        if so.kind == "regex":
            assert so.regex is not None
            return xgr.Grammar.from_regex(so.regex)
        return xgr.Grammar.from_ebnf(_ebnf(so))

    def matcher(self, compiled: xgrammar.CompiledGrammar) -> xgrammar.GrammarMatcher:
        return _import_xgrammar().GrammarMatcher(compiled)


def _schema_text(so: StructuredOutputsParams) -> str:
    return so.json if isinstance(so.json, str) else json.dumps(so.json, ensure_ascii=False)


def _ebnf(so: StructuredOutputsParams) -> str:
    """A choice list's or a grammar spec's EBNF."""
    if so.kind == "choice":
        assert so.choice is not None
        return choice_grammar(so.choice)
    assert so.grammar is not None
    return so.grammar


def _clean(msg: str) -> str:
    # xgrammar's messages start with "[time] /path/file.cc:line: "; keep what is after.
    first = msg.strip().splitlines()[0] if msg.strip() else msg
    if first.startswith("[") and ".cc:" in first:
        first = first.split(": ", 1)[-1]
    return first[:500]
