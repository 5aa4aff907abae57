"""--tp-size 2 on CPU (two scheduler processes on gloo) serves what --tp-size 1 serves (guided
decoding too); a dead rank takes the server down; --nnodes 2 runs as two launches on one machine."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from server_utils import start_server

from tandem.runtime.launcher import free_port

pytestmark = pytest.mark.timeout(240)

PROMPTS = [[5, 6, 7, 8], [9, 10], list(range(300, 380)), [42] * 17]


def _body(ids: list[int], **extra) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
            "return_logprob": True, "top_logprobs_num": 2, **extra}


def _serve_all(server) -> list[dict]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: one continuous batch
        return list(pool.map(lambda ids: server.generate(_body(ids)), PROMPTS))


@pytest.fixture(scope="module")
def tp_servers(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("tp")
    # one --random-seed for both: without it each launch draws its own, and seedless sampling differs
    common = ["--model-path", tiny_model_dir("llama"), "--max-total-tokens", "4000", "--random-seed", "0"]
    started = []
    try:
        for tp in (1, 2):
            started.append(start_server([*common, "--tp-size", str(tp)], str(logs / f"tp{tp}.log")))
        yield started
    finally:
        for server in started:
            server.stop()


def test_tp2_gives_tp1_tokens_and_logprobs(tp_servers):
    # first on both fresh servers, no seed: each scheduler draws its seeds from an RNG seeded by
    # --random-seed in arrival order, so both ranks of TP=2 sample alike and match TP=1 (ranks
    # with seeds of their own would feed different tokens into the shared hidden state)
    sampled = {"input_ids": PROMPTS[2], "sampling_params": {"max_new_tokens": 16, "temperature": 1.0}}
    assert tp_servers[1].generate(sampled)["output_ids"] == tp_servers[0].generate(sampled)["output_ids"]
    tp1, tp2 = (_serve_all(server) for server in tp_servers)
    for a, b in zip(tp1, tp2):
        assert a["output_ids"] == b["output_ids"]
        lp1 = [x[0] for x in a["meta_info"]["output_token_logprobs"]]
        lp2 = [x[0] for x in b["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(lp1, lp2)) < 1e-4  # fp32: the all-reduce only reorders sums
        assert [[t[1] for t in top] for top in a["meta_info"]["output_top_logprobs"]] == \
               [[t[1] for t in top] for top in b["meta_info"]["output_top_logprobs"]]


def test_tp2_n_samples_and_cache_hits(tp_servers):
    tp1, tp2 = tp_servers
    body = {"input_ids": PROMPTS[2], "sampling_params": {"max_new_tokens": 6, "temperature": 0.8, "n": 3,
                                                         "seed": 7}}
    first = tp2.generate(body)
    assert [o["output_ids"] for o in first] == [o["output_ids"] for o in tp1.generate(body)]
    again = tp2.generate(body)  # the prompt is cached now, on both ranks alike
    assert again[0]["meta_info"]["cached_tokens"] > 0
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in first]


def test_tp2_under_forced_retraction_gives_the_same_tokens(tp_servers, tiny_model_dir, tmp_path):
    """Every rank retracts and requeues alike (the same planner on the same inputs)."""
    server = start_server(["--model-path", tiny_model_dir("llama"), "--max-total-tokens", "4000", "--tp-size", "2"],
                          str(tmp_path / "retract.log"), env={"TANDEM_TEST_RETRACT": "1"})
    try:
        retracting = _serve_all(server)
        assert server.info()["num_retractions"] > 0
    finally:
        server.stop()
    for a, b in zip(_serve_all(tp_servers[0]), retracting):
        assert a["output_ids"] == b["output_ids"]
        assert [x[0] for x in a["meta_info"]["output_token_logprobs"]] == \
               pytest.approx([x[0] for x in b["meta_info"]["output_token_logprobs"]], abs=1e-4)


@pytest.mark.parametrize("tp", [1, 2])
def test_request_timeout_uses_rank0s_clock(tiny_model_dir, tmp_path, tp):
    """A request that waits past --request-timeout gets a 503 (under TP on every rank alike: rank
    0's clock decides); the blocker is untouched (each step sleeps 10 ms: it runs for seconds)."""
    server = start_server(["--model-path", tiny_model_dir("llama"), "--max-total-tokens", "4000", "--tp-size", str(tp),
                           "--max-running-requests", "1", "--request-timeout", "1"], str(tmp_path / "timeout.log"),
                          env={"TANDEM_TEST_FORWARD_HANG": "0.01"})
    try:
        with ThreadPoolExecutor(2) as pool:
            blocker = pool.submit(server.post, "/generate", {"input_ids": [5] * 4, "sampling_params": {
                "max_new_tokens": 300, "temperature": 0, "ignore_eos": True}})
            while server.info()["num_running_reqs"] < 1:
                time.sleep(0.05)
            waiting = server.post("/generate", {"input_ids": [6] * 4, "sampling_params": {"max_new_tokens": 4}})
            assert waiting.status_code == 503 and "request-timeout" in waiting.text
            assert blocker.result(60).status_code == 200
            assert len(blocker.result().json()["output_ids"]) == 300
    finally:
        server.stop()


def _constrained(k: int) -> dict:
    """Each its own grammar (so their compiles finish at different times on each rank), one that
    does not compile, and one unconstrained request in the same batch."""
    constraint = [{"regex": f"(ab|c{k})+[0-9]{{2,9}}"}, {"regex": "(("},
                  {"json_schema": f'{{"type": "object", "properties": {{"f{k}": {{"type": "integer"}}}}}}'}, {}][k % 4]
    return {"input_ids": [(i * 17 + k) % 20000 + 30 for i in range(12 + k)],
            "sampling_params": {"max_new_tokens": 12, "temperature": 0, **constraint}}


def _serve_constrained(server) -> list[tuple[int, list[int] | str]]:
    with ThreadPoolExecutor(8) as pool:  # concurrent: compiles and decodes overlap
        resps = list(pool.map(lambda k: server.post("/generate", _constrained(k)), range(8)))
    return [(r.status_code, r.json()["output_ids"] if r.status_code == 200 else r.json()["error"]["message"])
            for r in resps]


def test_tp2_guided_decoding_gives_tp1_tokens(tp_servers):
    """Every rank compiles its own grammars, but rank 0 decides which requests leave the grammar
    queue each iteration, so the ranks batch them alike (they used to be refused with a 400)."""
    tp1, tp2 = (_serve_constrained(server) for server in tp_servers)
    assert tp2 == tp1
    assert [code for code, _ in tp1] == [200, 400, 200, 200] * 2 and "does not compile" in tp1[1][1]


def test_killing_one_rank_ends_the_server_with_no_orphans(tiny_model_dir, tmp_path):
    server = start_server(["--model-path", tiny_model_dir("llama"), "--max-total-tokens", "4000",
                           "--tp-size", "2"], str(tmp_path / "server.log"))
    try:
        children = psutil.Process(server.proc.pid).children(recursive=True)
        pids = server.info()
        assert {pids["scheduler-tp0_pid"], pids["scheduler-tp1_pid"], pids["detokenizer_pid"]} <= \
               {p.pid for p in children}
        os.kill(pids["scheduler-tp1_pid"], signal.SIGKILL)
        assert server.proc.wait(30) != 0
        _, alive = psutil.wait_procs(children, timeout=10)
        assert alive == []
    finally:
        server.stop()


def test_two_nodes_on_one_machine(tiny_model_dir, tmp_path):
    """--nnodes 2: node 1 runs a scheduler rank only; node 0 serves. Stopping node 0 ends node 1."""
    dist = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}"]
    common = ["--model-path", tiny_model_dir("llama"), "--max-total-tokens", "4000", "--dtype", "float32", *dist]
    with open(tmp_path / "node1.log", "w") as log:
        node1 = subprocess.Popen([sys.executable, "-m", "tandem.launch.server", *common, "--node-rank", "1"],
                                 stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True)
    node0 = None
    try:
        node0 = start_server([*common, "--node-rank", "0"], str(tmp_path / "node0.log"))
        out = node0.generate(_body(PROMPTS[0]))
        assert len(out["output_ids"]) == 12
        node1_children = psutil.Process(node1.pid).children(recursive=True)
        ranks = [p for p in node1_children if "resource_tracker" not in " ".join(p.cmdline())]
        assert len(ranks) == 1  # one scheduler rank, no detokenizer
        node0.stop()
        assert node1.wait(60) != 0  # its rank lost its peer: the node goes down, loudly
        _, alive = psutil.wait_procs(node1_children, timeout=10)
        assert alive == []
    finally:
        if node0 is not None:
            node0.stop()
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
            node1.wait(10)
