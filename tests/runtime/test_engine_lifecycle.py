"""Engines of their own: SGLang's construction arguments, and a shutdown that ends every call in
flight, refuses later ones, wakes a call still being validated, gives back its event loop, and
happens at interpreter exit when the program forgot it."""
from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from tandem.runtime.engine import Engine, _server_args
from tandem.runtime.server_args import ServerArgs

pytestmark = pytest.mark.timeout(300)
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def _engine(tiny_model_dir) -> Engine:
    return Engine(tiny_model_dir("llama"), max_total_tokens=4000, max_running_requests=4, dtype="float32",
                  log_level="warning")


def test_engine_refuses_a_scheduler_only_node():
    with pytest.raises(ValueError, match="node_rank=1: nodes other than 0 run scheduler ranks only"):
        Engine(None, tp_size=2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:1")


def test_engine_arguments_as_sglangs():
    """SGLang's Engine logs only errors unless given a log_level (it lives inside the user's
    program: no line per decode batch), and takes a ready ServerArgs as `server_args`, alone."""
    assert _server_args(None, {}).log_level == "error"
    assert _server_args(None, {"log_level": "info"}).log_level == "info"
    ready = ServerArgs(max_total_tokens=4000, log_level="warning")
    assert _server_args(None, {"server_args": ready}) is ready
    with pytest.raises(TypeError, match="server_args cannot be combined with other arguments: max_total_tokens"):
        _server_args(None, {"server_args": ready, "max_total_tokens": 8})


async def _collect(stream) -> list:
    return [chunk async for chunk in stream]


def _event_fds() -> list[str]:
    """This process's epoll, io_uring and eventfd descriptors: what an event loop holds."""
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return sorted(link for link in links if link.startswith("anon_inode:[event") or "io_uring" in link)


def test_shutdown_ends_calls_in_flight_and_refuses_later_ones(tiny_model_dir):
    """Shutdown ends every call in flight, refuses later ones, and closes the Engine's event loop
    (an Engine per run left its epoll, io_uring and eventfd descriptors open)."""
    event_fds = _event_fds()
    engine = _engine(tiny_model_dir)
    try:
        _shutdown_with_calls_in_flight(engine)
    finally:
        engine.shutdown()  # a no-op after the test's own; frees the children when it failed early
    assert _event_fds() == event_fds


def _shutdown_with_calls_in_flight(engine: Engine) -> None:
    outcome: dict = {}
    # streams made before the shutdown and first iterated after it: handed to the loop only then
    early_sync = engine.generate(input_ids=[1, 2], sampling_params=GREEDY, stream=True)
    early_async = asyncio.run(engine.async_generate(input_ids=[1, 2], sampling_params=GREEDY, stream=True))

    def long_call():
        try:
            outcome["value"] = engine.generate(input_ids=[1, 2, 3],
                                               sampling_params={"max_new_tokens": 2000, "ignore_eos": True})
        except Exception as exc:  # the shutdown's error, raised in this thread
            outcome["error"] = exc

    caller = threading.Thread(target=long_call, daemon=True)
    caller.start()
    deadline = time.monotonic() + 60
    while engine.server_info()["num_running_reqs"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.server_info()["num_running_reqs"] == 1  # the shutdown below ends a call in flight
    engine.shutdown()
    caller.join(30)
    assert not caller.is_alive(), "a call in flight on another thread never returned after shutdown()"
    assert "shut down" in str(outcome.get("error"))
    for call in (lambda: engine.generate(input_ids=[1, 2], sampling_params=GREEDY),
                 lambda: engine.generate(input_ids=[1, 2], sampling_params=GREEDY, stream=True),
                 engine.server_info, engine.flush_cache):
        with pytest.raises(RuntimeError, match="has been shut down"):
            call()
    late: list = []

    def iterate_late() -> None:
        for consume in (lambda: list(early_sync), lambda: asyncio.run(_collect(early_async))):
            try:
                late.append(consume())
            except RuntimeError as exc:
                late.append(str(exc))

    reader = threading.Thread(target=iterate_late, daemon=True)
    reader.start()
    reader.join(30)
    assert not reader.is_alive(), "a stream first iterated after shutdown() never returned"
    assert late == ["the Engine has been shut down"] * 2
    engine.shutdown()  # a second shutdown is harmless


def test_an_engine_never_shut_down_stops_at_exit(tmp_path, tiny_model_dir):
    """A script that forgets shutdown(): the Engine stops at interpreter exit, while its loop
    thread still runs (a finalizer would wait for a loop that can no longer run), and leaves no
    IPC directory behind. SGLang's no-op flags are taken as keywords, as SGLang's Engine takes them."""
    import subprocess
    import sys

    script = (f"from tandem.runtime.engine import Engine\n"
              f"e = Engine({tiny_model_dir('llama')!r}, max_total_tokens=4000, dtype='float32', log_level='warning',"
              f" disable_cuda_graph=True)\n"
              f"print(len(e.generate(input_ids=[1, 2], sampling_params={GREEDY!r})['output_ids']))\n")
    ipc_root = tmp_path / "ipc"
    ipc_root.mkdir()
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, "TMPDIR": str(ipc_root)},
                          capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["6"]
    assert list(ipc_root.iterdir()) == []


def test_shutdown_wakes_a_call_still_being_validated(tiny_model_dir, monkeypatch):
    """A call not yet at the scheduler (a long prompt being tokenized in the validation pool) is
    cancelled by shutdown, and its caller gets the shutdown error instead of waiting forever."""
    import tandem.runtime.frontend.tokenizer_manager as tm_module

    engine = _engine(tiny_model_dir)
    validate = tm_module.normalize_generate_request
    validating = threading.Event()

    def slow_validation(*args, **kwargs):
        validating.set()
        time.sleep(2.0)
        return validate(*args, **kwargs)

    monkeypatch.setattr(tm_module, "normalize_generate_request", slow_validation)
    outcome: dict = {}

    def call():
        try:
            outcome["value"] = engine.generate(input_ids=[1, 2, 3], sampling_params=GREEDY)
        except Exception as exc:
            outcome["error"] = exc

    caller = threading.Thread(target=call, daemon=True)
    try:
        caller.start()
        assert validating.wait(30)  # the call is in validation when the shutdown comes
    finally:
        engine.shutdown()
    caller.join(20)
    assert not caller.is_alive() and "shut down" in str(outcome.get("error")), outcome
