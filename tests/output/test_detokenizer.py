"""Incremental detokenization equals tokenizers' decode for the three tokenizer families we
serve (GPT-2 ByteLevel BPE, sentencepiece-style byte-fallback BPE, Metaspace Unigram),
trained here on a small multilingual corpus."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from pipeline.output.detokenizer import DetokenizerTable

CORPUS = [
    "Hello world, this is a small corpus for the detokenizer tests.",
    "Déjà vu: café, naïve, façade, über, smörgåsbord, piñata.",
    "你好，世界。今天天气很好。我们在测试分词器。",
    "emoji 😀 🎉 👍🏽 and flags 🇫🇷 — dashes – and “quotes”.",
    "Код на русском: привет мир. Ελληνικά: γειά σου κόσμε.",
    "    indented\n\tcode = [1, 2, 3]  # comment\n",
] * 20
ALPHABET = "abc XYZ,.\n\té€ñü你好世界😀🎉👍🏽привет\u00a0\u200b"
SPECIALS = ["<s>", "</s>", "<unk>"]


def _bytelevel() -> Tokenizer:
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    t.add_tokens(["<extra>"])  # an added token that is not special
    return t


def _byte_fallback() -> Tokenizer:
    # Llama-2 layout: a BPE whose vocab lacks rare characters, which become <0xNN> tokens.
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    base.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                                         limit_alphabet=40))
    spec = json.loads(base.to_str())["model"]
    vocab = dict(spec["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["merges"]]
    t = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    t.normalizer = base.normalizer
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                   decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    t.add_special_tokens(SPECIALS)
    return t


def _metaspace() -> Tokenizer:
    t = Tokenizer(models.Unigram())
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Metaspace()
    t.train_from_iterator(CORPUS, trainers.UnigramTrainer(vocab_size=300, special_tokens=SPECIALS,
                                                          unk_token="<unk>"))
    return t


TOKENIZERS = {"bytelevel": _bytelevel(), "byte_fallback": _byte_fallback(), "metaspace": _metaspace()}
TABLES = {k: DetokenizerTable(t) for k, t in TOKENIZERS.items()}


def stream(kind: str, ids: list[int], skip: bool = True, prompt: list[int] | None = None) -> str:
    d = TABLES[kind].detokenizer(skip_special_tokens=skip, prompt_token_ids=prompt)
    parts = []
    for i in ids:
        parts.append(d.add_token(i))
        assert d.pending_bytes <= 3  # bounded state: per-token work never grows with the output
    return "".join(parts) + d.flush()


def check(kind: str, ids: list[int], skip: bool) -> None:
    tok = TOKENIZERS[kind]
    expected, got = tok.decode(ids, skip_special_tokens=skip), stream(kind, ids, skip)
    if kind != "byte_fallback" or "\ufffd" not in expected:
        assert got == expected
        return
    # Invalid byte runs: one U+FFFD per maximal invalid subpart, not per token (see the
    # module docstring); reference: the pieces' bytes decoded in one go.
    raw = b""
    for i in ids:
        if skip and i in TABLES[kind].special_ids:
            continue
        piece = tok.id_to_token(i)
        if piece.startswith("<0x") and len(piece) == 6:
            raw += bytes([int(piece[3:5], 16)])
        else:
            raw += piece.replace("▁", " ").encode()
    ref = raw.decode("utf-8", errors="replace")
    assert got == (ref[1:] if ref.startswith(" ") else ref)


def test_byte_fallback_really_splits_characters():
    tok = TOKENIZERS["byte_fallback"]
    pieces = tok.encode("你好😀").tokens
    assert sum(p.startswith("<0x") for p in pieces) >= 6, pieces
    # A character split across byte tokens is held back until complete, never mangled.
    ids = tok.encode("😀").ids
    d = TABLES["byte_fallback"].detokenizer(prompt_token_ids=tok.encode("a").ids)
    parts = [d.add_token(i) for i in ids]
    assert "".join(parts) == " 😀" and all("\ufffd" not in p for p in parts)


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=40), skip=st.booleans(),
       specials=st.lists(st.tuples(st.integers(0, 8), st.sampled_from(SPECIALS + ["<extra>"])), max_size=3))
def test_encoded_text_matches_decode(kind, text, skip, specials):
    tok = TOKENIZERS[kind]
    ids = tok.encode(text, add_special_tokens=False).ids
    for pos, name in specials:  # splice special / added tokens in anywhere, even mid-character
        tid = tok.token_to_id(name)
        if tid is not None:
            ids.insert(min(pos, len(ids)), tid)
    check(kind, ids, skip)


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace"])
@settings(max_examples=60, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_arbitrary_ids_match_decode(kind, data, skip):
    # Random ids produce invalid UTF-8 too: replacement characters must land where decode's do.
    tok = TOKENIZERS[kind]
    ids = data.draw(st.lists(st.integers(0, tok.get_vocab_size() - 1), max_size=30))
    assert stream(kind, ids, skip) == tok.decode(ids, skip_special_tokens=skip)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_byte_fallback_random_ids(data, skip):
    tok = TOKENIZERS["byte_fallback"]
    check("byte_fallback", data.draw(st.lists(st.integers(0, tok.get_vocab_size() - 1), max_size=30)), skip)


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
@settings(max_examples=40, deadline=None)
@given(prompt=st.text(alphabet=ALPHABET, min_size=1, max_size=20),
       out=st.text(alphabet=ALPHABET, max_size=30))
def test_continuation_of_prompt(kind, prompt, out):
    # Output text is what the prompt's decode grows by: a leading "▁" of the first output
    # token is a space, not stripped as at the start of a text.
    tok = TOKENIZERS[kind]
    p = tok.encode(prompt, add_special_tokens=False).ids
    o = tok.encode(out, add_special_tokens=False).ids
    if not p:
        return
    full, head = tok.decode(p + o), tok.decode(p)
    assert full.startswith(head)
    assert stream(kind, o, prompt=np.asarray(p, dtype=np.int32)) == full[len(head):]  # as the stage passes it


def test_incomplete_tail_is_held_back_then_replaced():
    tok = TOKENIZERS["byte_fallback"]
    e2 = tok.token_to_id("<0xE2>")
    d = TABLES["byte_fallback"].detokenizer(prompt_token_ids=[tok.token_to_id("a") or 5])
    assert d.add_token(e2) == ""  # could still become a 3-byte character
    assert d.add_token(tok.token_to_id("<0x82>")) == ""
    assert d.flush() == "\ufffd"


def test_unsupported_decoder_is_named():
    t = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    t.decoder = decoders.WordPiece()
    with pytest.raises(ValueError, match="WordPiece"):
        DetokenizerTable(t)


def test_table_from_path(tmp_path):
    path = tmp_path / "tokenizer.json"
    TOKENIZERS["bytelevel"].save(str(path))
    table = DetokenizerTable(path)
    ids = TOKENIZERS["bytelevel"].encode("你好 😀").ids
    d = table.detokenizer()
    assert "".join(map(d.add_token, ids)) + d.flush() == "你好 😀"
