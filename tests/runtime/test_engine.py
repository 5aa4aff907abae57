"""The embedded Engine: sync, streaming and async calls with /generate's semantics and SGLang's
Engine surface, bad input as an exception naming the field, aborts from any thread or loop, and a
consumer that stops reading ending its request (Engines of their own: test_engine_lifecycle.py)."""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import threading
import time

import pytest

from tandem.runtime.engine import Engine

pytestmark = pytest.mark.timeout(300)
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def _engine(tiny_model_dir) -> Engine:
    return Engine(tiny_model_dir("llama"), max_total_tokens=4000, max_running_requests=4, dtype="float32",
                  log_level="warning")


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with _engine(tiny_model_dir) as e:
        yield e


def test_sync_stream_and_async_calls_agree(engine):
    out = engine.generate(input_ids=[5, 6, 7, 8], sampling_params=GREEDY)
    assert len(out["output_ids"]) == 6 and out["meta_info"]["finish_reason"]["type"] == "length"
    chunks = list(engine.generate(input_ids=[5, 6, 7, 8], sampling_params=GREEDY, stream=True))
    assert chunks[-1]["output_ids"] == out["output_ids"] and chunks[-1]["text"] == out["text"]

    async def both():
        whole = await engine.async_generate(input_ids=[5, 6, 7, 8], sampling_params=GREEDY)
        streamed = [c async for c in await engine.async_generate(input_ids=[5, 6, 7, 8], sampling_params=GREEDY,
                                                                 stream=True)]
        return whole, streamed

    whole, streamed = asyncio.run(both())
    assert whole["output_ids"] == streamed[-1]["output_ids"] == out["output_ids"]
    batch = engine.generate(input_ids=[[5, 6, 7, 8], [9, 10]], sampling_params=GREEDY)
    assert [len(o["output_ids"]) for o in batch] == [6, 6] and batch[0]["output_ids"] == out["output_ids"]


def test_sglangs_engine_surface(engine):
    """SGLang's Engine names: get_server_info / get_model_info answer as /server_info and
    /model_info, tokenizer_manager.tokenizer is the tokenizer, server_args (the Engine's and the
    tokenizer manager's) the settings; return_prompt_token_ids as SGLang's."""
    info = engine.get_server_info()
    assert info["max_total_num_tokens"] == 4000 and info["dp_size"] == 1 and "num_running_reqs" in info
    assert engine.get_model_info()["architectures"] == ["LlamaForCausalLM"]
    tokenizer = engine.tokenizer_manager.tokenizer
    assert engine.server_args is engine.tokenizer_manager.server_args and engine.server_args.max_total_tokens == 4000
    out = engine.generate("Hello world", GREEDY, return_prompt_token_ids=True)
    assert out["prompt_token_ids"] == tokenizer.encode("Hello world")
    assert "prompt_token_ids" not in engine.generate("Hello world", GREEDY)


def test_flush_cache_answers_as_sglangs(engine):
    """SGLang's FlushCacheReqOutput: `.success`, False (with why) while a request runs."""
    flushed = engine.flush_cache()
    assert flushed.success and flushed
    stream = engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2000, "ignore_eos": True},
                             stream=True)
    next(stream)
    busy = engine.flush_cache()
    stream.close()
    assert not busy.success and not busy and busy.message


def _wait_idle(engine: Engine) -> None:
    deadline = time.monotonic() + 60
    while engine.get_server_info()["num_running_reqs"] and time.monotonic() < deadline:
        time.sleep(0.05)


def _wait_answered(engine: Engine, rid: str) -> None:
    """Until the tokenizer manager holds the request's finished answer: the scheduler goes idle
    a step or two before the detokenizer's last outputs reach it."""
    deadline = time.monotonic() + 60
    while not engine.tokenizer_manager.groups[rid].finished and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_busy_stream_consumer_gets_the_latest_chunk(engine):
    """As SGLang's Engine, a stream is read when its consumer asks: results that arrived while
    it was busy coalesce into one cumulative chunk (no backlog of every step, sync or async)."""
    params = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}
    stream = engine.generate(input_ids=[1, 2, 3], sampling_params=params, stream=True, rid="busy-sync")
    next(stream)
    _wait_answered(engine, "busy-sync")
    rest = list(stream)
    assert len(rest) == 1 and len(rest[0]["output_ids"]) == 200

    async def busy_async_consumer() -> list:
        chunks = await engine.async_generate(input_ids=[1, 2, 3], sampling_params=params, stream=True,
                                             rid="busy-async")
        await chunks.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, _wait_answered, engine, "busy-async")
        return [chunk async for chunk in chunks]

    rest = asyncio.run(busy_async_consumer())
    assert len(rest) == 1 and len(rest[0]["output_ids"]) == 200


def test_incremental_streams_yield_deltas_as_sglangs_engine(tiny_model_dir):
    """With incremental_streaming_output, SGLang's Engine yields each chunk's new text, ids and
    output logprobs; a busy consumer's next chunk is one delta of all it missed (sync and async),
    so the joined chunks are the non-streamed answer."""
    params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    with Engine(tiny_model_dir("llama"), max_total_tokens=4000, dtype="float32", log_level="warning",
                incremental_streaming_output=True) as engine:
        whole = engine.generate(input_ids=[1, 2, 3], sampling_params=params, return_logprob=True)
        stream = engine.generate(input_ids=[1, 2, 3], sampling_params=params, stream=True, return_logprob=True)
        chunks = [next(stream)]
        _wait_idle(engine)
        chunks += list(stream)
        assert len(chunks[0]["output_ids"]) < 40 and max(len(c["output_ids"]) for c in chunks[1:]) > 1
        # the scheduler reports idle once the request finished; its last step's output may still be
        # on its way through the detokenizer (CI: 39 of 40 in the coalesced chunk, then the last)
        assert len(chunks) <= 3 and chunks[-1]["meta_info"]["output_token_logprobs_length"] == 40
        assert "".join(c["text"] for c in chunks) == whole["text"]
        assert [i for c in chunks for i in c["output_ids"]] == whole["output_ids"]
        joined = [row[1] for c in chunks for row in c["meta_info"]["output_token_logprobs"]]
        assert joined == [row[1] for row in whole["meta_info"]["output_token_logprobs"]]

        async def batch() -> list:
            return [c async for c in await engine.async_generate(input_ids=[[1, 2, 3], [4, 5]],
                                                                  sampling_params=params, stream=True)]

        whole = engine.generate(input_ids=[[1, 2, 3], [4, 5]], sampling_params=params)
        chunks = asyncio.run(batch())
        for i in (0, 1):
            assert [t for c in chunks if c["index"] == i for t in c["output_ids"]] == whole[i]["output_ids"]


class _Interrupted(Exception):
    pass


def test_an_interrupted_sync_call_aborts_its_request(engine):
    """Ctrl-C in a sync generate() ends the request, as cancelling an async caller does: it is
    aborted (its KV and rid freed), not left running to its max_new_tokens."""
    import signal

    def interrupt_once_running() -> None:
        deadline = time.monotonic() + 30
        while "ctrl-c" not in engine.tokenizer_manager.groups and time.monotonic() < deadline:
            time.sleep(0.005)
        os.kill(os.getpid(), signal.SIGUSR1)

    def interrupted(*_: object) -> None:
        raise _Interrupted()

    metrics = engine.tokenizer_manager.metrics

    def aborts() -> float:
        return metrics.registry.get_sample_value("sglang:num_aborted_requests_total", metrics.labels)

    aborted_before = aborts()
    previous = signal.signal(signal.SIGUSR1, interrupted)
    try:
        threading.Thread(target=interrupt_once_running, daemon=True).start()
        with pytest.raises(_Interrupted):
            engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2000, "ignore_eos": True},
                            rid="ctrl-c")
    finally:
        signal.signal(signal.SIGUSR1, previous)
    deadline = time.monotonic() + 60
    while "ctrl-c" in engine.tokenizer_manager.groups and time.monotonic() < deadline:
        time.sleep(0.01)
    assert aborts() == aborted_before + 1  # ended by an abort, not run to its 2000 tokens


def test_tokenizer_manager_abort_request_from_the_callers_thread_and_loop(engine):
    """SGLang's embedding programs abort with `engine.tokenizer_manager.abort_request(rid=...)`,
    from their own thread or event loop: the abort reaches the scheduler (the manager's sockets
    belong to the engine's loop thread) and the stream ends with an abort."""
    long = {"max_new_tokens": 2000, "ignore_eos": True}
    stream = engine.generate(input_ids=[1, 2, 3], sampling_params=long, stream=True, rid="tm-abort-thread")
    next(stream)
    aborter = threading.Thread(target=engine.tokenizer_manager.abort_request, kwargs={"rid": "tm-abort-thread"})
    aborter.start()
    aborter.join(10)
    assert list(stream)[-1]["meta_info"]["finish_reason"]["type"] == "abort"

    async def abort_from_my_loop() -> dict:
        chunks = await engine.async_generate(input_ids=[1, 2, 3], sampling_params=long, stream=True,
                                             rid="tm-abort-loop")
        await chunks.__anext__()
        engine.tokenizer_manager.abort_request(rid="tm-abort-loop")
        return [chunk async for chunk in chunks][-1]

    assert asyncio.run(abort_from_my_loop())["meta_info"]["finish_reason"]["type"] == "abort"
    engine.abort_request(abort_all=True)  # SGLang's Engine name too; nothing runs, nothing breaks
    assert not engine.tokenizer_manager.groups


def test_tokenizer_manager_control_calls_from_the_callers_loop(engine):
    """`await engine.tokenizer_manager.flush_cache()` / `.server_info()` from the caller's own event
    loop answer at once: they took the whole control timeout (10 s), their reply set on the
    engine's loop never waking the caller's."""
    tm = engine.tokenizer_manager

    async def control_calls() -> tuple:
        return await tm.flush_cache(), await tm.server_info()

    started = time.monotonic()
    flushed, info = asyncio.run(control_calls())
    assert flushed.success and info["num_running_reqs"] == 0
    assert time.monotonic() - started < 5  # a hang detector: the answers take milliseconds


def test_a_consumer_that_stops_aborts_its_request(engine):
    """A stream dropped mid-way (sync), a `for` left by break, a cancelled asyncio task reading a
    stream or awaiting a whole answer: each request is aborted, its KV freed, nothing left running."""
    long = {"max_new_tokens": 2000, "ignore_eos": True}
    metrics, tm = engine.tokenizer_manager.metrics, engine.tokenizer_manager

    def aborts() -> float:
        return metrics.registry.get_sample_value("sglang:num_aborted_requests_total", metrics.labels)

    before = aborts()
    dropped = engine.generate(input_ids=[1, 2, 3], sampling_params=long, stream=True)
    next(dropped), next(dropped)
    del dropped
    for _ in engine.generate(input_ids=[[1, 2], [3, 4]], sampling_params={**long, "n": 2}, stream=True):
        break

    async def cancelled_readers() -> None:
        async def read_all() -> None:
            async for _ in await engine.async_generate(input_ids=[5, 6], sampling_params=long, stream=True,
                                                       rid="cancelled-stream"):
                pass

        tasks = [asyncio.ensure_future(read_all()),
                 asyncio.ensure_future(engine.async_generate(input_ids=[7, 8], sampling_params=long, rid="cancelled"))]
        while not {"cancelled-stream", "cancelled"} <= tm.groups.keys():
            await asyncio.sleep(0.01)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(cancelled_readers())
    _wait_idle(engine)
    info = engine.get_server_info()
    assert not tm.groups and info["num_running_reqs"] == 0 and info["kv_slots_used"] == 0
    assert aborts() == before + 1 + 4 + 2  # every choice of each call ended by an abort


def test_an_async_stream_closed_as_its_loop_ends_logs_no_error(engine, caplog):
    """An async stream still open when its caller's asyncio.run ends is closed by that loop, and
    its request aborted on the engine's loop after the caller's loop has closed: that is a normal
    end, not a "Task exception was never retrieved" error in the embedding program's log."""
    long = {"max_new_tokens": 2000, "ignore_eos": True}

    async def take_one_chunk() -> None:
        chunks = await engine.async_generate(input_ids=[1, 2, 3], sampling_params=long, stream=True)
        await chunks.__anext__()

    tm = engine.tokenizer_manager
    for _ in range(5):
        asyncio.run(take_one_chunk())
        deadline = time.monotonic() + 30
        while tm.groups and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not tm.groups  # the open stream's request was aborted
    time.sleep(0.2)  # the pumps' futures are done on the engine's loop; collect them
    gc.collect()
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_bad_input_raises_naming_the_field(engine):
    with pytest.raises(TypeError, match="as prompt or as text, not both"):
        engine.generate("Hello", GREEDY, text="world")
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": -1})
    assert engine.flush_cache()


def test_engine_keywords_as_sglangs_signature(engine):
    """A keyword SGLang's Engine.generate does not take is a TypeError at the call, as Python
    raises it there, sync or async, streamed or not (not an error at the first chunk); a stream flag
    that is no bool is refused before a stream is returned; and nothing past input_ids is
    positional (SGLang's fourth positional is image_data: here it would silently pick streaming)."""
    for stream in (False, True):
        with pytest.raises(TypeError, match="unexpected keyword argument 'max_tokens'"):
            engine.generate(input_ids=[5, 6], sampling_params=GREEDY, stream=stream, max_tokens=4)
        with pytest.raises(TypeError, match="unexpected keyword argument 'max_tokens'"):
            asyncio.run(engine.async_generate(input_ids=[5, 6], stream=stream, max_tokens=4))
    with pytest.raises(ValueError, match="stream must be a boolean, got str"):
        engine.generate(input_ids=[5, 6], sampling_params=GREEDY, stream="no")
    with pytest.raises(TypeError, match="positional"):
        engine.generate("Hello", GREEDY, None, "image.png")
    with pytest.raises(ValueError, match="image_data is not supported"):  # SGLang's keyword: refused by name
        engine.generate("Hello", GREEDY, image_data="image.png")
    assert len(engine.generate("Hello", GREEDY, image_data=None)["output_ids"]) == 6  # and still serving
