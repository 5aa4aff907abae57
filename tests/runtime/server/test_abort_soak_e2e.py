"""A seeded soak of aborts, disconnects and bad requests under forced retraction and chunked prefill.

Greedy requests drawn from a few templates (shared prompt prefixes, so radix hits; streamed or not;
n > 1; logprobs; stop strings, min_new_tokens, regex) run concurrently on overlap servers that
retract every 3 decode steps, with and without STANDALONE speculation. Some are aborted by rid at a
random moment (at once, while a long prompt prefills in 16-token chunks, mid-decode, after they
finished), some clients go away (mid-stream, or before an unstreamed answer), and invalid requests
come in between. Invariants:
- a request nobody aborted or dropped returns what its template returns alone, logprobs aligned;
- an aborted one ends with finish_reason abort, or its normal output when it was done first;
- afterwards the server is idle, leaks nothing, and still serves (it did not die)."""
from __future__ import annotations

import random
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import orjson
import pytest
import requests

from server_utils import assert_no_leaks

pytestmark = pytest.mark.timeout(300)
HTTP_TIMEOUT_S = 60
PREFIXES = [[(11 * i + 7 * k) % 30000 + 100 for i in range(n)] for k, n in enumerate((24, 90, 200))]
BAD_BODIES = [  # each a 400 naming the field
    ({"text": "x", "sampling_params": {"temperature": -1}}, "temperature"),
    ({"text": "x", "sampling_params": {"max_new_tokens": "many"}}, "max_new_tokens"),
    ({"text": "x", "sampling_params": {"regex": "(unclosed"}}, "regex"),
    ({"text": "x", "sampling_params": {"n": 0}}, "n"),
    ({"input_ids": [5, -3]}, "input_ids"),
    ({"text": "x", "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 3}}, "min_new_tokens"),
]


@dataclass
class Job:
    rid: str
    body: dict  # the template: what the request asks, whatever happens to it
    stream: bool
    abort_at: str | None = None  # "now", "prefill", "decode", "finished"
    drop_after: int | None = None  # the client goes away after this many chunks (0 unstreamed: before the answer)


def templates(rng: random.Random, count: int) -> list[dict]:
    out = []
    for t in range(count):
        prefix = rng.choice(PREFIXES)
        sp: dict = {"temperature": 0, "max_new_tokens": rng.randint(1, 40), "ignore_eos": rng.random() < 0.5}
        kind = rng.choice(("plain", "plain", "stop", "min_new", "regex"))
        if kind == "stop":
            sp["stop"] = [rng.choice(("e", "an", "ing", " t"))]
        elif kind == "min_new":
            sp["min_new_tokens"] = rng.randint(0, sp["max_new_tokens"])
        elif kind == "regex":
            # a bound of its own: each a grammar compile, so aborts also land while one compiles
            sp["regex"] = rng.choice(("[a-z ]{1,%d}", "(yes|no|maybe){1,%d}[.!]", "[0-9]{2,%d}")) % rng.randint(3, 40)
        if rng.random() < 0.25:
            sp["n"] = rng.choice((2, 3))
        body = {"input_ids": prefix + [rng.randrange(100, 30000) for _ in range(rng.randint(0, 12))],
                "sampling_params": sp}
        if rng.random() < 0.4:
            body.update(return_logprob=True, top_logprobs_num=rng.choice((0, 2)))
        out.append(body)
    return out


def plan(rng: random.Random, bodies: list[dict], count: int) -> list[Job]:
    jobs = []
    for i in range(count):
        body = rng.choice(bodies)
        job = Job(f"soak-{i}", body, stream=rng.random() < 0.5)
        roll = rng.random()
        if roll < 0.3:
            job.abort_at = rng.choice(("now", "prefill", "decode", "finished"))
            if job.abort_at == "prefill":  # a prompt of its own, not in the radix cache: 16 chunks to prefill
                job.body = {**body, "input_ids": [rng.randrange(100, 30000) for _ in range(256)] + body["input_ids"]}
        elif roll < 0.4:  # a streamed client after some chunks, another before its answer
            job.drop_after = rng.randint(0, 3) if job.stream else 0
        jobs.append(job)
    return jobs


def _abort(url: str, rid: str) -> None:
    assert requests.post(url + "/abort_request", json={"rid": rid}, timeout=HTTP_TIMEOUT_S).status_code == 200


def _stream(url: str, job: Job, on_chunk) -> list[dict] | None:
    """The last chunk of each choice, or None when the client went away."""
    last: dict[int, dict] = {}
    with requests.post(url + "/generate", json={**job.body, "rid": job.rid, "stream": True}, stream=True,
                       timeout=HTTP_TIMEOUT_S) as resp:
        assert resp.status_code == 200, resp.text
        for n, line in enumerate(line for line in resp.iter_lines() if line.startswith(b"data: {")):
            if job.drop_after is not None and n >= job.drop_after:
                return None  # leaving the with-block closes the connection mid-stream
            chunk = orjson.loads(line[len(b"data: "):])
            last[chunk.get("index", 0)] = chunk
            on_chunk(chunk)
    return [last[i] for i in sorted(last)]


def run_job(url: str, job: Job) -> list[dict] | None:
    """The job's choices as the client saw them (None: it went away)."""
    aborted = threading.Event()

    def abort_once() -> None:
        if not aborted.is_set():
            aborted.set()
            _abort(url, job.rid)

    delay = random.Random(job.rid)
    if job.abort_at == "now":  # the abort may come before the request: then it aborts nothing
        threading.Timer(delay.uniform(0, 0.01), abort_once).start()
    elif job.abort_at == "prefill":
        threading.Timer(delay.uniform(0.01, 0.1), abort_once).start()
    if job.stream:
        choices = _stream(url, job, lambda chunk: job.abort_at == "decode" and abort_once())
    else:
        if job.abort_at == "decode":
            threading.Timer(delay.uniform(0.02, 0.3), abort_once).start()
        timeout = (HTTP_TIMEOUT_S, delay.uniform(0.01, 0.2)) if job.drop_after == 0 else HTTP_TIMEOUT_S
        try:
            resp = requests.post(url + "/generate", json={**job.body, "rid": job.rid}, timeout=timeout)
        except requests.ReadTimeout:
            return None  # the client went away before the answer came
        assert resp.status_code == 200, resp.text
        choices = resp.json() if isinstance(resp.json(), list) else [resp.json()]
    if job.abort_at == "finished":
        abort_once()
    return choices


def bad_request(url: str, body: dict, field: str) -> None:
    resp = requests.post(url + "/generate", json=body, timeout=HTTP_TIMEOUT_S)
    assert resp.status_code == 400 and field in resp.json()["error"]["message"], (body, resp.text)


def check_like(choice: dict, ref: dict, rid: str) -> None:
    """Same tokens, text and finish as alone; logprobs one per token, equal to float noise."""
    assert choice["output_ids"] == ref["output_ids"], rid
    assert choice["text"] == ref["text"], rid
    meta, ref_meta = choice["meta_info"], ref["meta_info"]
    assert meta["finish_reason"] == ref_meta["finish_reason"], rid
    assert meta["completion_tokens"] == len(choice["output_ids"]), rid
    if "output_token_logprobs" in ref_meta:
        rows, ref_rows = meta["output_token_logprobs"], ref_meta["output_token_logprobs"]
        assert [r[1] for r in rows] == choice["output_ids"], rid
        assert [r[0] for r in rows] == pytest.approx([r[0] for r in ref_rows], abs=1e-4), rid
        assert len(meta.get("output_top_logprobs", [])) == len(ref_meta.get("output_top_logprobs", [])), rid


def check_aborted(choice: dict, ref: dict, rid: str) -> str:
    """An aborted choice: an abort with a prefix of the answer, or the whole answer. Returns where it
    landed: before its first token, mid-decode, or after it finished."""
    reason = choice["meta_info"]["finish_reason"]
    if reason["type"] != "abort":
        check_like(choice, ref, rid)
        return "finished"
    n = len(choice["output_ids"])
    assert choice["output_ids"] == ref["output_ids"][:n], rid
    assert choice["meta_info"]["completion_tokens"] == n, rid
    if "output_token_logprobs" in choice["meta_info"]:
        assert [r[1] for r in choice["meta_info"]["output_token_logprobs"]] == choice["output_ids"], rid
    return "decode" if n else "before first token"


def soak(server, seed: int, num_jobs: int, workers: int = 16) -> Counter:
    """Runs the jobs, checks every invariant, and counts what happened."""
    rng = random.Random(seed)
    bodies = templates(rng, 24)
    jobs = plan(rng, bodies, num_jobs)
    with ThreadPoolExecutor(workers) as pool:
        futures = []
        for i, job in enumerate(jobs):
            futures.append(pool.submit(run_job, server.url, job))
            if i % 40 == 20:  # invalid requests in between the others
                pool.submit(bad_request, server.url, *BAD_BODIES[i // 40 % len(BAD_BODIES)]).result(HTTP_TIMEOUT_S)
        outs = [f.result(timeout=120) for f in futures]
    assert server.proc.poll() is None
    assert_no_leaks(server)  # idle: 0 running, 0 queued, every slot and row back
    refs = {}
    for job, choices in zip(jobs, outs):  # each distinct body alone, on the idle server
        if choices is not None and id(job.body) not in refs:
            ref = server.generate(job.body)
            refs[id(job.body)] = ref if isinstance(ref, list) else [ref]
    counts: Counter = Counter()
    for job, choices in zip(jobs, outs):
        if choices is None:
            counts["dropped"] += 1
            continue
        ref = refs[id(job.body)]
        assert len(choices) == len(ref), job.rid
        for choice, ref_choice in zip(choices, ref):
            if job.abort_at is None:
                check_like(choice, ref_choice, job.rid)
                counts["whole"] += 1
            else:
                counts[f"abort {job.abort_at}: {check_aborted(choice, ref_choice, job.rid)}"] += 1
    assert_no_leaks(server)
    return counts


# the second drafts with a model (it lost its scheduler to one request with min_new_tokens)
@pytest.mark.parametrize("name", ["tiny_overlap_chunked_retract", "tiny_standalone_overlap_chunked_retract"])
def test_aborts_disconnects_and_bad_requests_leave_others_exact_and_nothing_behind(servers, name):
    server = servers(name)
    retractions = server.info()["num_retractions"]
    counts = soak(server, seed=44, num_jobs=300)
    print(dict(counts))
    assert server.info()["num_retractions"] > retractions
    assert counts["whole"] > 100 and counts["dropped"] > 5
    for phase in ("before first token", "decode", "finished"):
        assert sum(n for key, n in counts.items() if key.endswith(phase)) > 3, counts
