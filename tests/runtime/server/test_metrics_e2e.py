"""/metrics after known traffic: parsed with prometheus_client's parser, the counts match."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(300)  # a server start may take 180 s (server_utils)


def _scrape(server) -> dict[tuple[str, str], float]:
    resp = server.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            if "le" not in s.labels:
                out[(s.name, s.labels.get("finish_type", ""))] = s.value
    return out


def test_metrics_count_known_traffic(tiny_server):
    before = _scrape(tiny_server)
    sp = {"temperature": 0, "ignore_eos": True}
    tiny_server.generate({"input_ids": [5, 6, 7], "sampling_params": {**sp, "max_new_tokens": 4}})
    tiny_server.generate({"input_ids": [8, 9], "sampling_params": {**sp, "max_new_tokens": 6, "n": 2}})
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(tiny_server.generate, {"input_ids": [10], "rid": "metrics-abort",
                                                 "sampling_params": {**sp, "max_new_tokens": 1500}})
        while tiny_server.info()["num_running_reqs"] == 0:
            time.sleep(0.02)
        tiny_server.post("/abort_request", {"rid": "metrics-abort"})
        aborted = fut.result(30)
    # a streaming client that goes away: its request is aborted, and counted, as SGLang counts it
    stream = requests.post(tiny_server.url + "/generate", json={"input_ids": [11], "stream": True, "sampling_params": {
        **sp, "max_new_tokens": 1500}}, stream=True, timeout=60)
    next(stream.iter_lines())
    stream.close()
    # neither a health probe nor a request with SGLang's log_metrics: false is counted
    assert tiny_server.get("/health_generate").status_code == 200
    tiny_server.generate({"input_ids": [12], "log_metrics": False, "sampling_params": {**sp, "max_new_tokens": 2}})
    deadline = time.monotonic() + 10
    while tiny_server.info()["num_running_reqs"] and time.monotonic() < deadline:
        time.sleep(0.05)
    after = _scrape(tiny_server)

    def delta(name: str, finish_type: str = "") -> float:
        return after.get((name, finish_type), 0.0) - before.get((name, finish_type), 0.0)

    assert delta("sglang:num_requests_total") == 5  # one request, two choices, the aborted and the dropped one
    assert delta("tandem:num_requests_by_finish_type_total", "length") == 3
    assert delta("tandem:num_requests_by_finish_type_total", "abort") == 2
    assert delta("sglang:num_aborted_requests_total") == 2
    assert delta("sglang:prompt_tokens_total") == 3 + 2 * 2 + 1 + 1
    assert delta("sglang:generation_tokens_total") >= 4 + 2 * 6 + len(aborted["output_ids"]) + 1
    assert delta("sglang:e2e_request_latency_seconds_count") == 5
    assert delta("sglang:time_to_first_token_seconds_count") >= 3
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:cache_hit_rate",
                 "sglang:gen_throughput", "tandem:device_idle_fraction", "tandem:num_retractions"):
        assert (name, "") in after, name
    info = tiny_server.info()
    assert info["scheduler_pid"] > 0 and info["detokenizer_pid"] > 0


def test_a_scrape_during_a_long_step_answers_with_the_last_gauges(tmp_path, tiny_model_dir):
    """Each forward step sleeps 12 s, longer than a control request's 10 s: /metrics still
    answers (the request metrics are current, the gauges as last seen), where it used to wait
    for the scheduler and fail with a 503."""
    from server_utils import start_server

    server = start_server(["--model-path", tiny_model_dir("llama"), "--max-total-tokens", "2000"],
                          str(tmp_path / "slow.log"), env={"TANDEM_TEST_FORWARD_HANG": "12"})
    try:
        assert server.get("/metrics").status_code == 200  # idle: the scheduler answers
        with ThreadPoolExecutor(1) as pool:
            done = pool.submit(server.generate, {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}})
            time.sleep(1.0)  # inside the 12 s step
            resp = server.get("/metrics")
            assert resp.status_code == 200 and "sglang:num_running_reqs" in resp.text
            assert len(done.result(60)["output_ids"]) == 1
    finally:
        server.stop()
