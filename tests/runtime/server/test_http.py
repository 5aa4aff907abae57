"""Native HTTP routes: against a real server, SGLang's legacy /get_load and the random seed a
launch drew, logged and reported by /get_server_info; without one, the control routes' checks."""
from __future__ import annotations

import re
from typing import Any

import pytest

from server_utils import start_server

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("http") / "server.log"
    handle = start_server(["--model-path", tiny_model_dir("llama"), "--max-total-tokens", "3000",
                           "--log-level", "info", "--stream-response-default-include-usage"], str(log))
    try:
        yield handle
    finally:
        handle.stop()


def test_get_load_is_sglangs_legacy_view_of_the_loads(server):
    server.generate({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}})
    resp = server.get("/get_load")
    assert resp.status_code == 200, resp.text
    (load,) = resp.json()  # one entry per DP rank
    loads = server.get("/v1/loads").json()["loads"][0]
    assert (load["dp_rank"], load["num_reqs"], load["num_waiting_reqs"]) == (0, 0, 0)
    assert load["num_tokens"] == loads["num_used_tokens"] and isinstance(load["ts_tic"], float)


def test_the_drawn_random_seed_is_logged_and_reported(server):
    """No --random-seed: the launch drew one (SGLang's default; it was always 0), and the schedulers
    and /get_server_info have that one."""
    seed = server.info()["random_seed"]
    assert isinstance(seed, int) and 0 <= seed <= 1 << 30
    assert re.search(rf"random seed: {seed} \(drawn for this launch", server.log()), server.log()[-2000:]


def _request(path: str, headers: dict[str, str]) -> Any:
    from starlette.requests import Request

    return Request({"type": "http", "method": "POST", "path": path, "query_string": b"", "scheme": "http",
                    "server": ("127.0.0.1", 30000), "headers": [(k.encode(), v.encode()) for k, v in headers.items()]})


@pytest.mark.parametrize("headers, json_body, needs_admin, status", [
    ({"content-type": "application/json"}, True, False, None),
    ({"content-type": "Application/JSON; charset=utf-8"}, True, False, None),
    ({"content-type": "text/plain"}, True, False, 415),  # what a cross-site form can send
    ({}, True, False, 415),
    ({}, False, False, None),  # a gateway's bodiless POST /flush_cache
    ({"sec-fetch-site": "same-origin"}, False, False, None),
    ({"sec-fetch-site": "cross-site"}, False, False, 403),  # a browser's cross-site request
    ({"origin": "http://evil.example"}, False, False, 403),
    ({"content-type": "application/json", "authorization": "Bearer user"}, True, True, 403),
    ({"content-type": "application/json", "authorization": "Bearer admin"}, True, True, None),
])
def test_control_routes_refuse_cross_site_requests_and_non_admin_keys(headers, json_body, needs_admin, status):
    from tandem.runtime.frontend.request_groups import RequestError
    from tandem.runtime.server.http_common import control_request
    from tandem.runtime.server_args import ServerArgs

    args = ServerArgs(api_key="user", admin_api_key="admin")
    request = _request("/flush_cache", headers)
    if status is None:
        control_request(request, args, needs_admin, json_body)
        return
    with pytest.raises(RequestError) as err:
        control_request(request, args, needs_admin, json_body)
    assert err.value.status_code == status and "/flush_cache" in err.value.message


def test_the_dp_rank_header_is_checked_and_wins_over_the_body():
    """SGLang's X-Data-Parallel-Rank pins a request to a DP rank on every generation route, over the
    body's routed_dp_rank / data_parallel_rank: not an integer, or not this server's one rank (0),
    is a 400 naming the header (it was ignored: a rank of 3 got a 200)."""
    from tandem.runtime.server.http import header_dp_rank, with_header_dp_rank
    from tandem.runtime.value_checks import ValidationError

    assert header_dp_rank(_request("/generate", {})) is None
    assert header_dp_rank(_request("/generate", {"x-data-parallel-rank": "0"})) == 0
    for value in ("3", "-1", "abc", "0.0", ""):
        with pytest.raises(ValidationError) as err:
            header_dp_rank(_request("/generate", {"x-data-parallel-rank": value}))  # as servers hand it over
        assert err.value.field == "X-Data-Parallel-Rank", value
    body = {"text": "hi", "routed_dp_rank": 3, "data_parallel_rank": 2}
    assert with_header_dp_rank(body, 0) == {"text": "hi", "routed_dp_rank": 0}
    assert with_header_dp_rank(body, None) is body and with_header_dp_rank([1], 0) == [1]


def test_the_dp_rank_header_on_the_generation_routes(server):
    prompt = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}}
    for headers in ({"X-Data-Parallel-Rank": "3"}, {"x-data-parallel-rank": "two"}):
        bad = server.post("/generate", prompt, headers=headers)
        assert bad.status_code == 400 and "X-Data-Parallel-Rank" in bad.json()["error"]["message"], bad.text
    # the header's 0 wins over a body rank that alone is refused
    assert server.post("/generate", {**prompt, "routed_dp_rank": 3}).status_code == 400
    assert server.post("/generate", {**prompt, "routed_dp_rank": 3}, headers={"X-Data-Parallel-Rank": "0"}
                       ).status_code == 200
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
                       ("/v1/responses", {"input": "hi", "max_output_tokens": 1})):
        bad = server.post(path, body, headers={"X-Data-Parallel-Rank": "3"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Data-Parallel-Rank", (path, bad.text)
        assert server.post(path, body, headers={"X-Data-Parallel-Rank": "0"}).status_code == 200, path


def test_chat_stream_reasoning_false_streams_the_reasoning_in_one_delta(servers):
    """SGLang's stream_reasoning: false on a chat stream (--reasoning-parser): the reasoning comes
    in one reasoning_content delta, equal to the unstreamed answer's (it was streamed piece by piece)."""
    import json

    server = servers("tiny_reasoning")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 40,
            "regex": r"<think>[a-z]{4,12} [a-z]{4,12} [a-z]{4,12}</think>[A-Z][a-z]{3,10}", "require_reasoning": False}
    whole = server.post("/v1/chat/completions", body).json()["choices"][0]["message"]
    resp = server.post("/v1/chat/completions", {**body, "stream": True, "stream_reasoning": False}, stream=True)
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in resp.iter_lines(decode_unicode=True)
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert [d["reasoning_content"] for d in deltas if "reasoning_content" in d] == [whole["reasoning_content"]]
    assert "".join(d.get("content") or "" for d in deltas) == whole["content"]
    bad = server.post("/v1/chat/completions", {**body, "stream_reasoning": "no"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stream_reasoning"


def _stream_chunks(server, path: str, body: dict) -> list[dict]:
    import json

    resp = server.post(path, {**body, "stream": True}, stream=True)
    assert resp.status_code == 200, resp.text
    return [json.loads(line[6:]) for line in resp.iter_lines(decode_unicode=True)
            if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 3, "temperature": 0}),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
])
def test_stream_response_default_include_usage_ends_streams_with_usage(server, path, body):
    """SGLang's --stream-response-default-include-usage: a stream ends with a usage chunk whether or
    not stream_options asks (include_usage false included: SGLang ORs the two), and only the last."""
    for options in ({}, {"stream_options": {"include_usage": False}}):
        chunks = _stream_chunks(server, path, {**body, **options})
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3, chunks[-1]
        assert all(c.get("usage") is None for c in chunks[:-1])
