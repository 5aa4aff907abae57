"""GET /ready, the readiness probe: 200 {"status": "ready"} once a request sent now is served at
once; 503 naming the reason while starting, draining, after a child died, or while paused."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tandem.runtime.frontend.tokenizer_manager import SHUTTING_DOWN
from tandem.runtime.server.http import create_app
from tandem.runtime.server_args import ServerArgs

pytestmark = pytest.mark.timeout(180)


class _FakeTM:
    def __init__(self, not_serving: str | None = None, paused: bool = False) -> None:
        self._reason, self.paused = not_serving, paused

    def not_serving(self) -> str | None:
        return self._reason


def _ready(tm: _FakeTM | None):
    app = create_app(ServerArgs())
    if tm is not None:
        app.state.tm = tm
    return TestClient(app).get("/ready")  # no `with`: the lifespan (children) never starts


@pytest.mark.parametrize("tm, reason", [
    (None, "starting"),  # the lifespan has not handed over the tokenizer manager yet
    (_FakeTM(SHUTTING_DOWN), SHUTTING_DOWN),
    (_FakeTM("the scheduler died"), "the scheduler died"),
    (_FakeTM(paused=True), "generation is paused"),
])
def test_not_ready_is_a_503_naming_why(tm, reason):
    resp = _ready(tm)
    assert resp.status_code == 503 and reason in resp.json()["error"]["message"], resp.text


def test_ready_when_serving_in_process():
    resp = _ready(_FakeTM())
    assert resp.status_code == 200 and resp.json() == {"status": "ready"}


def test_a_started_server_is_ready(servers):
    resp = servers("tiny").get("/ready")
    assert resp.status_code == 200 and resp.json() == {"status": "ready"}, resp.text



def test_a_paused_server_is_not_ready_until_continue(servers):
    server = servers("tiny_rl")  # pause changes the server for whoever comes next: the RL tests' own
    try:
        assert server.post("/pause_generation", {"mode": "in_place"}).status_code == 200
        resp = server.get("/ready")
        assert resp.status_code == 503 and "paused" in resp.json()["error"]["message"], resp.text
        assert server.get("/health").status_code == 200  # alive, only not taking new work now
    finally:
        assert server.post("/continue_generation").status_code == 200
    assert server.get("/ready").status_code == 200
