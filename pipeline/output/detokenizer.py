"""Token processor stage: incremental detokenization, linear in output length.

State: one ``DetokenizerTable`` per tokenizer (token id -> raw bytes, built once from the
``tokenizers`` JSON: vocab, added tokens, decoder) and one ``IncrementalDetokenizer`` per
request (an incremental UTF-8 decoder plus two flags).

Why bytes: re-decoding a window of ids per step (vLLM's prefix/read offsets) costs a
``decode`` call per token and turns quadratic when the window keeps growing on incomplete
UTF-8. Here each token's bytes go through ``codecs``' incremental UTF-8 decoder, which holds
back an incomplete multi-byte sequence (a character split across tokens, byte-fallback
``<0xNN>`` tokens, GPT-2 byte-level pieces) until it completes, so each token costs O(its
bytes) and the text already emitted never changes.

The result equals ``tokenizer.decode(ids, skip_special_tokens=...)`` for the supported
decoders: ByteLevel; Metaspace; and Sequence of Replace (string pattern), ByteFallback, Fuse,
Strip (leading only, after Fuse), Metaspace. Added tokens go through the decoder like any
other token, their content being their token string; special ones are dropped first when
``skip_special_tokens``, so the "first token" rules (Metaspace prefix, Strip) apply to the
first token kept. One documented difference: an *invalid* run of byte-fallback tokens is
replaced per maximal invalid subpart (Unicode's recommended practice, which ByteLevel's
lossy decode follows too), where ``tokenizers``' ByteFallback writes one U+FFFD per token of
the run; valid UTF-8 is always identical.
"""
from __future__ import annotations

import codecs
import json
import re
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _gpt2_unicode_to_byte() -> dict[str, int]:
    # GPT-2 maps each byte to a printable code point: printable Latin-1 bytes map to
    # themselves, the other 68 to 256, 257, ... in byte order.
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in keep}
    n = 0
    for b in range(256):
        if b not in keep:
            table[chr(256 + n)] = b
            n += 1
    return table


class DetokenizerTable:
    """Immutable per-tokenizer tables; share one across all requests (and threads)."""

    def __init__(self, tokenizer: Tokenizer | str | Path) -> None:
        if not isinstance(tokenizer, Tokenizer):
            tokenizer = Tokenizer.from_file(str(tokenizer))
        spec = json.loads(tokenizer.to_str())
        self._parse_decoder(spec.get("decoder"))
        vocab = tokenizer.get_vocab(with_added_tokens=False)
        # Added tokens win over the model vocab, as in tokenizers' id_to_token.
        for t in spec.get("added_tokens") or []:
            vocab[t["content"]] = t["id"]
        self.special_ids: frozenset[int] = frozenset(
            t["id"] for t in spec.get("added_tokens") or [] if t["special"])
        self.vocab_size = max(vocab.values(), default=-1) + 1
        self.token_bytes: list[bytes | None] = [None] * self.vocab_size
        # Metaspace drops the replacement char from the first token of the text.
        self.first_bytes: dict[int, bytes] = {}
        u2b = _gpt2_unicode_to_byte() if self.byte_level else {}
        for tok, tid in vocab.items():
            self.token_bytes[tid] = self._token_to_bytes(tok, u2b)
            if self.metaspace is not None and self.metaspace in tok:
                self.first_bytes[tid] = self._token_to_bytes(tok.replace(self.metaspace, ""), u2b)

    def _parse_decoder(self, dec: dict | None) -> None:
        self.byte_level = False
        self.byte_fallback = False
        self.metaspace: str | None = None
        self.replacements: list[tuple[str, str]] = []
        self.strip: tuple[str, int] | None = None
        if dec is None:
            raise ValueError("tokenizer has no decoder: incremental detokenization needs one")
        steps = dec["decoders"] if dec["type"] == "Sequence" else [dec]
        fused = False
        for d in steps:
            kind = d["type"]
            if kind == "ByteLevel":
                self.byte_level = True
            elif kind == "ByteFallback":
                self.byte_fallback = True
            elif kind == "Fuse":
                fused = True
            elif kind == "Replace" and "String" in d["pattern"]:
                self.replacements.append((d["pattern"]["String"], d["content"]))
            elif kind == "Metaspace":
                self.metaspace = d["replacement"]
                if d.get("prepend_scheme", "always") == "never" or d.get("add_prefix_space") is False:
                    self.replacements.append((d["replacement"], " "))
                    self.metaspace = None
            elif kind == "Strip" and fused and d.get("stop", 0) == 0:
                self.strip = (d["content"], int(d["start"]))
            else:
                raise ValueError(f"unsupported decoder step {kind!r} (supported: ByteLevel, Metaspace, "
                                 "Replace(String), ByteFallback, Fuse, Strip(start) after Fuse)")
        if self.byte_level and (self.metaspace or self.byte_fallback or self.replacements):
            raise ValueError("unsupported decoder: ByteLevel combined with other steps")

    def _token_to_bytes(self, tok: str, u2b: dict[str, int]) -> bytes:
        if self.byte_fallback and (m := _BYTE_TOKEN.match(tok)):
            return bytes([int(m.group(1), 16)])
        if self.byte_level:
            try:
                return bytes(u2b[c] for c in tok)
            except KeyError:  # not a byte-level piece: tokenizers falls back to its UTF-8
                return tok.encode()
        for pat, rep in self.replacements:
            tok = tok.replace(pat, rep)
        if self.metaspace is not None:
            tok = tok.replace(self.metaspace, " ")
        return tok.encode()

    def detokenizer(self, skip_special_tokens: bool = True,
                    prompt_token_ids: Sequence[int] | None = None) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens, prompt_token_ids)


class IncrementalDetokenizer:
    """Per-request state: feed ids with ``add_token(s)``, call ``flush`` once at the end.

    With ``prompt_token_ids`` the output is decoded as a continuation of the prompt (a
    leading "▁Hello" stays " Hello"), i.e. ``decode(prompt + out)[len(decode(prompt)):]``;
    without, as the start of a text (``decode(out)``). Only the prompt's tail is inspected.
    """

    __slots__ = ("_t", "_skip", "_utf8", "_first", "_strip_left")

    def __init__(self, table: DetokenizerTable, skip_special_tokens: bool = True,
                 prompt_token_ids: Sequence[int] | None = None) -> None:
        self._t = table
        self._skip = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        tail = () if prompt_token_ids is None else prompt_token_ids
        self._first = not any(self._kept(int(t)) for t in reversed(tail))
        self._strip_left = table.strip[1] if table.strip and self._first else 0

    def _kept(self, tid: int) -> bool:
        t = self._t
        if not 0 <= tid < t.vocab_size or t.token_bytes[tid] is None:
            return False  # unknown ids are skipped, as tokenizers' decode does
        return not (self._skip and tid in t.special_ids)

    def add_token(self, token_id: int) -> str:
        """Return the text this token completes (possibly empty: an incomplete character)."""
        if not self._kept(token_id):
            return ""
        raw = self._t.token_bytes[token_id]
        if self._first:
            self._first = False
            raw = self._t.first_bytes.get(token_id, raw)
        text = self._utf8.decode(raw)  # type: ignore[arg-type]
        if self._strip_left and text:
            text = self._strip(text)
        return text

    @property
    def pending_bytes(self) -> int:
        """Bytes held back (an incomplete character): at most 3, which is what keeps every
        token's cost independent of the output length."""
        return len(self._utf8.getstate()[0])

    def flush(self) -> str:
        """End of output: an incomplete trailing character becomes U+FFFD, like decode()."""
        text = self._utf8.decode(b"", True)
        self._utf8.reset()
        if self._strip_left and text:
            text = self._strip(text)
        return text

    def _strip(self, text: str) -> str:
        char = self._t.strip[0]  # type: ignore[index]
        i = 0
        while i < len(text) and self._strip_left and text[i] == char:
            i += 1
            self._strip_left -= 1
        if i < len(text):
            self._strip_left = 0  # only the text's leading chars are stripped
        return text[i:]
