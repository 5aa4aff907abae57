"""End-to-end /generate against real server processes (tiny random model unless the real one matters)."""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import orjson
import pytest
import requests

from server_utils import assert_no_leaks

pytestmark = pytest.mark.timeout(300)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(3, 120))] for _ in range(n)]


def _greedy(ids: list[int], max_new: int = 16, **extra) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}, **extra}


def run_concurrently(server, bodies: list[dict]) -> list[dict]:
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(server.generate, bodies))


def test_capital_of_france_on_smollm2(smol_server):
    out = smol_server.generate({"text": "The capital of France is",
                                "sampling_params": {"max_new_tokens": 16, "temperature": 0}})
    assert "Paris" in out["text"]
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 16}
    assert meta["prompt_tokens"] == 5 and meta["completion_tokens"] == 16 == len(out["output_ids"])
    assert set(meta) >= {"id", "cached_tokens", "e2e_latency"} and meta["weight_version"] == "default"
    # what SGLang's clients read: bench_serving internal_states[0], the gateway's dp_size and model name
    info = smol_server.info()
    assert info["dp_size"] == 1 and info["served_model_name"] == "SmolLM2-135M-Instruct"
    assert set(info["internal_states"][0]) == {"last_gen_throughput"}
    assert smol_server.get("/get_model_info").json()["weight_version"] == "default"


def test_batch_input_returns_a_list_in_order(tiny_server):
    prompts = _prompts(3, seed=1)
    out = tiny_server.generate({"input_ids": prompts, "sampling_params": {"max_new_tokens": 5, "temperature": 0}})
    assert isinstance(out, list) and [o["index"] for o in out] == [0, 1, 2]
    for o, p in zip(out, prompts):
        assert o["meta_info"]["prompt_tokens"] == len(p)
        single = tiny_server.generate({"input_ids": p, "sampling_params": {"max_new_tokens": 5, "temperature": 0}})
        assert single["output_ids"] == o["output_ids"]
    # SGLang serves /generate on PUT too
    put = requests.put(tiny_server.url + "/generate", json={"input_ids": prompts[0], "sampling_params": {
        "max_new_tokens": 5, "temperature": 0}}, timeout=60)
    assert put.status_code == 200 and put.json()["output_ids"] == out[0]["output_ids"]


def test_streaming_is_cumulative_and_ends_with_done(tiny_server):
    # 200 tokens: a stream coalesces what arrives while the client reads, and 8 tiny-model tokens
    # from a cached prompt came in one chunk once the CPU path got fast
    body = _greedy(_prompts(1, seed=2)[0], 200)
    final = tiny_server.generate(body)
    resp = requests.post(tiny_server.url + "/generate", json={**body, "stream": True}, stream=True, timeout=60)
    events = [line for line in resp.iter_lines() if line]
    assert events[-1] == b"data: [DONE]"
    chunks = [orjson.loads(e[len(b"data: "):]) for e in events[:-1]]
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(lengths) and lengths[-1] == 200 and len(chunks) >= 2
    for a, b in zip(chunks, chunks[1:]):
        assert b["output_ids"][:len(a["output_ids"])] == a["output_ids"]
        assert b["text"].startswith(a["text"])
    assert chunks[-1]["output_ids"] == final["output_ids"] and chunks[-1]["text"] == final["text"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert "e2e_latency" in chunks[-1]["meta_info"] and not any("e2e_latency" in c["meta_info"] for c in chunks[:-1])


def _sse(server, path: str, body: dict, after_first=None) -> list[dict]:
    resp = requests.post(server.url + path, json={**body, "stream": True}, stream=True, timeout=120)
    chunks = []
    for line in resp.iter_lines():
        if line.startswith(b"data: {"):
            chunks.append(orjson.loads(line[len(b"data: "):]))
            if len(chunks) == 1 and after_first is not None:
                after_first()
    return chunks


def _joined(chunks: list[dict], index: int = 0) -> dict:
    mine = [c for c in chunks if c.get("index", 0) == index]
    meta = {key: [row for c in mine for row in c["meta_info"].get(key, [])]
            for key in ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")}
    return {"text": "".join(c["text"] for c in mine), "output_ids": [i for c in mine for i in c["output_ids"]],
            "meta_info": {**mine[-1]["meta_info"], **meta}}


def _rows(rows: list) -> list:
    """A logprob list's token ids, and its values to float noise (a prompt cached or not)."""
    out: list = []
    for row in rows:
        if not row or isinstance(row[0], list):  # a position without values, or its top rows
            out.append(row and _rows(row))
        else:
            out.append((row[1], None if row[0] is None else pytest.approx(row[0], abs=1e-4)))
    return out


def test_incremental_streaming_output_chunks_join_into_the_answer(servers):
    """--incremental-streaming-output, as SGLang's: each /generate chunk has only the text,
    output_ids and output logprobs new since the previous one, the joined chunks are the
    non-streamed answer (single with every output logprob list and stream_interval 3, a stop
    string held back, batch and n > 1), also when aborted mid-stream; OpenAI streams are as without it."""
    server = servers("tiny_incremental_retract")
    assert server.info()["incremental_streaming_output"] is True  # /server_info lists it, as SGLang's
    greedy = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    text = server.generate({"text": "Hello there", "sampling_params": greedy})["text"]
    bodies = [{"text": "Hello there", "sampling_params": {**greedy, "stream_interval": 3}, "return_logprob": True,
               "top_logprobs_num": 2, "token_ids_logprob": [5, 9], "logprob_start_len": 0},
              {"text": "Hello there", "sampling_params": {**greedy, "stop": [text[6:9]]}},
              {"text": ["Hello there", "one two"], "sampling_params": greedy},
              {"text": "x y", "sampling_params": {**greedy, "n": 2, "temperature": 0.8, "sampling_seed": 5}}]
    for body in bodies:
        whole = server.generate(body)
        chunks = _sse(server, "/generate", body)
        for i, answer in enumerate(whole if isinstance(whole, list) else [whole]):
            joined = _joined(chunks, i)
            assert (joined["text"], joined["output_ids"]) == (answer["text"], answer["output_ids"]), body
            for key in ("input_token_logprobs", "output_token_logprobs", "output_top_logprobs",
                        "output_token_ids_logprobs"):
                assert _rows(joined["meta_info"].get(key, [])) == _rows(answer["meta_info"].get(key, [])), key
            assert joined["meta_info"]["output_token_logprobs_length" if body.get("return_logprob") else
                                       "completion_tokens"] == len(answer["output_ids"])
    assert len(_sse(server, "/generate", bodies[0])) >= 3  # deltas, not one final chunk
    def abort() -> None:
        requests.post(server.url + "/abort_request", json={"rid": "inc-abort"}, timeout=30)

    chunks = _sse(server, "/generate", {"rid": "inc-abort", "text": "Hello", "return_logprob": True,
                                        "sampling_params": {**greedy, "max_new_tokens": 2000}}, abort)
    joined = _joined(chunks)
    assert joined["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(joined["output_ids"]) == joined["meta_info"]["completion_tokens"] == len(
        joined["meta_info"]["output_token_logprobs"]) < 2000
    openai = {"model": "m", "prompt": "Hello there", "max_tokens": 24, "temperature": 0}
    deltas = _sse(server, "/v1/completions", openai)
    full = server.post("/v1/completions", json=openai).json()["choices"][0]["text"]
    assert "".join(c["choices"][0]["text"] for c in deltas if c["choices"]) == full
    assert_no_leaks(server)


def test_64_concurrent_mixed_lengths_equal_one_at_a_time(tiny_server):
    prompts = _prompts(64, seed=3)
    bodies = [_greedy(p, 4 + i % 13) for i, p in enumerate(prompts)]
    concurrent = run_concurrently(tiny_server, bodies)
    alone = [tiny_server.generate(b) for b in bodies]
    for c, a in zip(concurrent, alone):
        assert c["output_ids"] == a["output_ids"]
    assert [len(c["output_ids"]) for c in concurrent] == [4 + i % 13 for i in range(64)]
    assert_no_leaks(tiny_server)


def test_radix_cache_hit_reports_cached_tokens_and_same_output(tiny_server):
    prefix = _prompts(1, seed=4)[0] * 3
    tiny_server.generate(_greedy(prefix + [501, 502], 4))
    hit = tiny_server.generate(_greedy(prefix + [601, 602, 603], 6))
    assert hit["meta_info"]["cached_tokens"] >= len(prefix)
    assert tiny_server.post("/flush_cache").status_code == 200
    cold = tiny_server.generate(_greedy(prefix + [601, 602, 603], 6))
    assert cold["meta_info"]["cached_tokens"] == 0
    assert cold["output_ids"] == hit["output_ids"]


def test_chunked_prefill_forced_retraction_and_overlap_modes_agree(servers):
    """Same greedy outputs from: the plain server; chunked prefill (16) + forced retraction with
    overlap off; the same with overlap on. 32 concurrent requests, some sharing prefixes."""
    base = _prompts(24, seed=5)
    shared = [base[0] * 2 + p[:5] for p in base[:8]]  # radix hits across requests
    bodies = [_greedy(p, 12 + i % 7) for i, p in enumerate(base + shared)]
    reference = run_concurrently(servers("tiny"), bodies)
    for name in ("tiny_sequential_chunked_retract", "tiny_overlap_chunked_retract"):
        server = servers(name)
        retractions = server.info()["num_retractions"]
        got = run_concurrently(server, bodies)
        assert [g["output_ids"] for g in got] == [r["output_ids"] for r in reference], name
        assert server.info()["num_retractions"] > retractions  # this run was retracted, not an earlier one
        assert_no_leaks(server)


def test_flush_cache_frees_every_slot(tiny_server):
    run_concurrently(tiny_server, [_greedy(p, 3) for p in _prompts(8, seed=6)])
    assert_no_leaks(tiny_server)


def test_v1_loads_sections(tiny_server):
    """SGLang's ?include= sections, spaces around the commas allowed; an unknown one is a 400."""
    loads = requests.get(tiny_server.url + "/v1/loads", params={"include": "core, queues"}, timeout=30).json()
    assert "queues" in loads["loads"][0] and loads["dp_rank_count"] == 1
    assert "queues" not in requests.get(tiny_server.url + "/v1/loads?include=core", timeout=30).json()["loads"][0]
    bad = requests.get(tiny_server.url + "/v1/loads?include=core,bogus", timeout=30)
    assert bad.status_code == 400 and "include" in bad.text
