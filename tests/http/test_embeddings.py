"""End to end, embeddings: `pipeline serve --http` on the default model driven by the `openai`
SDK's ``embeddings.create`` (float and base64, one input and lists, token ids), the ZMQ
``Client.embed``, and the refusals (``dimensions`` other than the hidden size, empty input,
a prompt over max_model_len), each a 400 naming the field. Every vector equals the in-process
``LLM.embed``'s for the same prompt.
"""
from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
from e2e_helpers import serving

from pipeline import LLM
from pipeline.client import Client
from pipeline.config import DEFAULT_MODEL

KEY = "k"
HIDDEN = 256  # the default model's hidden size
FLAGS = ("--device", "cpu", "--dtype", "float32", "--max-num-seqs", "8", "--max-model-len", "64",
         "--num-blocks", "64", "--max-num-batched-tokens", "16")
TEXTS = ["the quick brown fox jumps over the lazy dog and keeps on running far away", "hello"]


@pytest.fixture(scope="module")
def daemon():
    yield from serving(DEFAULT_MODEL, "--api-key", KEY, *FLAGS, http=True)


@pytest.fixture(scope="module")
def reference():
    """In-process vectors of TEXTS and of their token ids (same engine flags)."""
    with LLM(DEFAULT_MODEL, device="cpu", dtype="float32", max_model_len=64, num_blocks=64) as llm:
        outs = llm.embed(TEXTS)
        return [np.asarray(o.outputs.embedding) for o in outs], [o.prompt_token_ids for o in outs]


@pytest.fixture
def oai(daemon):
    with openai.OpenAI(base_url=f"{daemon.http_url}/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


def test_float_list_and_usage(oai, reference):
    vecs, ids = reference
    r = oai.embeddings.create(model="default", input=TEXTS)
    assert r.object == "list" and r.model == "default"
    assert [d.index for d in r.data] == [0, 1] and all(d.object == "embedding" for d in r.data)
    for d, want in zip(r.data, vecs):
        assert len(d.embedding) == HIDDEN
        np.testing.assert_allclose(d.embedding, want, atol=1e-5)
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))


def test_base64_single_input_and_token_ids(oai, reference):
    vecs, ids = reference
    raw = httpx.post(f"{oai.base_url}embeddings", headers={"Authorization": f"Bearer {KEY}"},
                     json={"input": TEXTS[0], "encoding_format": "base64", "user": "u1"}, timeout=60)
    assert raw.status_code == 200, raw.text
    got = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(got, vecs[0], atol=1e-5)
    # The SDK asks for base64 by default and decodes it itself.
    r = oai.embeddings.create(model="default", input=TEXTS[1])
    np.testing.assert_allclose(r.data[0].embedding, vecs[1], atol=1e-5)
    # Token ids: one list, and a list of lists.
    r = oai.embeddings.create(model="default", input=ids[0], encoding_format="float")
    np.testing.assert_allclose(r.data[0].embedding, vecs[0], atol=1e-5)
    r = oai.embeddings.create(model="default", input=ids, encoding_format="float", dimensions=HIDDEN)
    for d, want in zip(r.data, vecs):
        np.testing.assert_allclose(d.embedding, want, atol=1e-5)


@pytest.mark.parametrize("kw, field", [
    (dict(input="x", dimensions=64), "dimensions"),
    (dict(input=[]), "input"),
    (dict(input=["fine", ""]), "input[1]"),
    (dict(input=[["a"]]), "input"),
    (dict(input=[[5] * 65]), "input[0]"),  # over max_model_len (64)
    (dict(input=[9999]), "input"),  # outside the vocabulary
])
def test_refusals_name_the_field(oai, kw, field):
    with pytest.raises(openai.BadRequestError) as e:
        oai.embeddings.create(model="default", encoding_format="float", **kw)
    assert e.value.status_code == 400
    assert e.value.body["param"] == field, e.value.body
    assert f"`{field}`" in e.value.body["message"]


def test_unknown_model_is_404(oai):
    with pytest.raises(openai.NotFoundError):
        oai.embeddings.create(model="other", input="x")


def test_zmq_client_embed_beside_generation(daemon, reference):
    vecs, ids = reference
    with Client(daemon.address, timeout=60) as c:
        r = c.embed(TEXTS[0])
        assert r.error is None and r.token_ids == [] and r.usage.prompt_tokens == len(ids[0])
        np.testing.assert_allclose(r.embedding, vecs[0], atol=1e-5)
        g = c.generate(prompt_token_ids=ids[1], max_tokens=4, temperature=0.0, ignore_eos=True)
        assert len(g.token_ids) == 4 and g.embedding is None
