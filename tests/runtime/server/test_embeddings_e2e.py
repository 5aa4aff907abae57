"""Embeddings (--is-embedding): /v1/embeddings through the openai client and SGLang's /encode give
what transformers' AutoModel gives on the same checkpoint (the final norm's last-token row,
normalized, as the model folder's sentence-transformers modules say), share the radix cache, and
bad input is a 400 naming the field; generation routes on such a server are refused."""
from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.timeout(300)
TEXTS = ["The capital of France is Paris.", "hello", "a b c d e f g"]


def _reference(model_dir: str, texts: list[str]) -> np.ndarray:
    from transformers import AutoModel, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(model_dir), AutoModel.from_pretrained(model_dir, dtype=torch.float32)
    rows = []
    for text in texts:
        ids = tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            last = model(ids).last_hidden_state[0, -1]
        rows.append((last / last.norm()).numpy())
    return np.stack(rows)


@pytest.fixture(scope="module")
def server(servers):
    return servers("tiny_embedding")


def test_openai_embeddings_equal_transformers(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    out = client.embeddings.create(model="m", input=TEXTS)
    got = np.array([d.embedding for d in out.data])
    want = _reference(server.get("/model_info").json()["model_path"], TEXTS)
    # float32 both ways; tandem's kernels sum in another order than transformers' (rounding only)
    assert got.shape == want.shape and np.abs(got - want).max() < 1e-4
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert out.usage.prompt_tokens == out.usage.total_tokens > 0
    short = client.embeddings.create(model="m", input="hello", dimensions=16)
    assert len(short.data[0].embedding) == 16 and abs(np.linalg.norm(short.data[0].embedding) - 1) < 1e-5
    b64 = server.post("/v1/embeddings", {"input": "hello", "encoding_format": "base64"}).json()
    raw = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), "<f4")
    assert np.array_equal(raw, np.array(client.embeddings.create(model="m", input="hello").data[0].embedding, "<f4"))


def test_encode_takes_text_or_ids_and_shares_the_cache(server):
    one = server.post("/encode", {"text": TEXTS[0]}).json()
    again = server.post("/encode", {"text": TEXTS[0]}).json()
    assert one["embedding"] == again["embedding"]  # deterministic, cache hit or not
    assert again["meta_info"]["cached_tokens"] > 0
    batch = server.post("/encode", {"input_ids": [[5, 6, 7], [8, 9]]}).json()
    assert isinstance(batch, list) and len(batch) == 2 and len(batch[0]["embedding"]) == len(one["embedding"])


@pytest.mark.parametrize("path, body, field", [
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": "x", "dimensions": 100000}, "dimensions"),
    ("/v1/embeddings", {"input": "x", "normalize": True}, "normalize"),
    ("/encode", {"text": "x", "input_ids": [1]}, "text"),
])
def test_bad_input_is_a_400_naming_the_field(server, path, body, field):
    reply = server.post(path, body)
    assert reply.status_code == 400 and field in reply.text, reply.text


def test_generation_is_refused_on_an_embedding_server_and_embeddings_elsewhere(server, servers):
    assert server.post("/generate", {"text": "hi"}).status_code == 400
    assert "--is-embedding" in servers("tiny").post("/v1/embeddings", {"input": "hi"}).text
