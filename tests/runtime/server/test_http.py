"""Native HTTP routes against a real server: SGLang's legacy /get_load, and the random seed a
launch drew, logged and reported by /get_server_info."""
from __future__ import annotations

import re

import pytest

from server_utils import start_server

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("http") / "server.log"
    handle = start_server(["--model-path", tiny_model_dir("llama"), "--max-total-tokens", "3000",
                           "--log-level", "info"], str(log))
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
