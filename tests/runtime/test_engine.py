"""The embedded Engine: sync, streaming and async calls with /generate's semantics, bad input as
an exception naming the field, and a shutdown that ends every call in flight and refuses later ones."""
from __future__ import annotations

import asyncio
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


def test_engine_refuses_a_scheduler_only_node():
    with pytest.raises(ValueError, match="node_rank=1: nodes other than 0 run scheduler ranks only"):
        Engine(None, tp_size=2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:1")


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
    /model_info, tokenizer_manager.tokenizer is the tokenizer; return_prompt_token_ids as SGLang's."""
    info = engine.get_server_info()
    assert info["max_total_num_tokens"] == 4000 and info["dp_size"] == 1 and "num_running_reqs" in info
    assert engine.get_model_info()["architectures"] == ["LlamaForCausalLM"]
    tokenizer = engine.tokenizer_manager.tokenizer
    out = engine.generate("Hello world", GREEDY, return_prompt_token_ids=True)
    assert out["prompt_token_ids"] == tokenizer.encode("Hello world")
    assert "prompt_token_ids" not in engine.generate("Hello world", GREEDY)


def test_bad_input_raises_naming_the_field(engine):
    with pytest.raises(Exception, match="max_new_tokens"):
        engine.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": -1})
    assert engine.flush_cache()


def test_shutdown_ends_calls_in_flight_and_refuses_later_ones(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    outcome: dict = {}

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
    engine.shutdown()
    caller.join(30)
    assert not caller.is_alive(), "a call in flight on another thread never returned after shutdown()"
    assert "shut down" in str(outcome.get("error"))
    for call in (lambda: engine.generate(input_ids=[1, 2], sampling_params=GREEDY),
                 lambda: engine.generate(input_ids=[1, 2], sampling_params=GREEDY, stream=True),
                 engine.server_info, engine.flush_cache):
        with pytest.raises(RuntimeError, match="has been shut down"):
            call()
    engine.shutdown()  # a second shutdown is harmless


def test_shutdown_wakes_a_call_still_being_validated(tiny_model_dir, monkeypatch):
    """A call not yet at the scheduler (a long prompt being tokenized in the validation pool) is
    cancelled by shutdown, and its caller gets the shutdown error instead of waiting forever."""
    import tandem.runtime.tokenizer_manager as tm_module

    engine = _engine(tiny_model_dir)
    validate = tm_module.normalize_generate_request

    def slow_validation(*args, **kwargs):
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
    caller.start()
    time.sleep(0.5)
    engine.shutdown()
    caller.join(20)
    assert not caller.is_alive() and "shut down" in str(outcome.get("error")), outcome
