"""Training-loop methods of the Engine (and their HTTP routes' checks): a server on tiny model A
updated to B from disk, from a safetensors file and over a trainer's gloo group answers exactly as
a fresh server on B, token for token, with B's weights readable and the cache dropped; a weight
that does not fit is refused by name and A keeps serving; pause (abort / retract / in place) and
continue keep their promises."""
from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from tandem.launch.make_tiny_model import build_tiny_model
from tandem.runtime.engine import Engine
from tandem.runtime.model.loader import load_config, load_hf_weights
from tandem.runtime.model.weight_sync import broadcast, flatten, init_weights_group

pytestmark = pytest.mark.timeout(600)
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42], [100, 7, 300, 9, 2000, 3]]
Q0 = "model.layers.0.self_attn.q_proj.weight"


def _engine(path: str) -> Engine:
    return Engine(path, max_total_tokens=4000, max_running_requests=4, log_level="warning")


def _greedy(engine: Engine) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl")
    a, b = (str(build_tiny_model(root / name, "qwen2", seed=seed)) for name, seed in (("a", 0), ("b", 1)))
    expected = {}
    for name, path in (("a", a), ("b", b)):
        with _engine(path) as fresh:
            expected[name] = _greedy(fresh)
            expected[f"{name}_q0"] = fresh.get_weights_by_name(Q0, truncate_size=3)
    assert expected["a"] != expected["b"]
    return a, b, expected


@pytest.fixture(scope="module")
def engine(models):
    with _engine(models[0]) as e:
        yield e


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(engine: Engine, world_size: int, group_name: str):
    """The test process joins as the trainer (rank 0) while the engine's ranks join after it."""
    port, trainer = _free_port(), {}
    joining = threading.Thread(target=lambda: trainer.update(g=init_weights_group("127.0.0.1", port, 0, world_size,
                                                                                  group_name)))
    joining.start()
    ok, message = engine.init_weights_update_group("127.0.0.1", port, rank_offset=1, world_size=world_size,
                                                   group_name=group_name)
    joining.join(60)
    assert ok, message
    return trainer["g"]


def _push(engine: Engine, group, weights: dict[str, torch.Tensor], group_name: str, **kw) -> tuple[bool, str]:
    """The trainer broadcasts every tensor (or, flattened_bucket, one buffer of them all) while the
    engine receives them."""
    names = list(weights)
    if kw.get("load_format") == "flattened_bucket":
        sending = threading.Thread(target=lambda: broadcast(group, flatten([weights[n] for n in names])))
    else:
        sending = threading.Thread(target=lambda: [broadcast(group, weights[n].contiguous()) for n in names])
    sending.start()
    result = engine.update_weights_from_distributed(names, [weights[n].dtype for n in names],
                                                    [list(weights[n].shape) for n in names], group_name=group_name,
                                                    **kw)
    sending.join(60)
    return result


def test_update_from_disk_serves_b_exactly_and_drops_the_cache(engine, models):
    a, b, expected = models
    assert _greedy(engine) == expected["a"]  # (the prompts are cached now)
    ok, message = engine.update_weights_from_disk(b, weight_version="b-1")
    assert ok, message
    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == expected["b"]
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in outs)  # KV of A's weights is never reused
    assert all(o["meta_info"]["weight_version"] == "b-1" for o in outs)
    assert engine.get_server_info()["weight_version"] == "b-1"
    assert engine.get_weights_by_name(Q0, truncate_size=3) == expected["b_q0"]


def test_a_weight_that_does_not_fit_is_refused_by_name_and_the_old_weights_keep_serving(engine, models):
    a, b, expected = models
    engine.update_weights_from_disk(a)
    ok, message = engine.update_weights_from_tensor([("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 3))])
    assert not ok and "model.layers.0.mlp.up_proj.weight" in message and "does not fit" in message
    ok, message = engine.update_weights_from_tensor([("model.layers.0.nope.weight", torch.zeros(3, 3))])
    assert not ok and "no such weight" in message
    assert _greedy(engine) == expected["a"]
    with pytest.raises(ValueError, match="load_format"):
        engine.update_weights_from_disk(b, load_format="pt")


def test_update_from_a_safetensors_file_of_b(engine, models):
    a, b, expected = models
    engine.update_weights_from_disk(a)
    ok, message = engine.update_weights_from_tensor(list(load_hf_weights(b, load_config(b)).items()))
    assert ok, message
    assert _greedy(engine) == expected["b"]


def test_update_over_a_trainers_gloo_group(engine, models):
    """The test process is the trainer: rank 0 of a world of 2, broadcasting B's tensors."""
    a, b, expected = models
    engine.update_weights_from_disk(a)
    group = _join(engine, 2, "g")
    ok, message = _push(engine, group, load_hf_weights(b, load_config(b)), "g", weight_version="b-dist")
    assert ok, message
    assert _greedy(engine) == expected["b"]
    assert engine.destroy_weights_update_group("g")[0]
    assert not engine.destroy_weights_update_group("g")[0]


def test_a_refused_broadcast_update_still_takes_every_tensor_and_the_group_serves_on(engine, models):
    """A shape that does not fit is refused before the first byte, but the trainer's broadcasts
    are all received: the next update over the same group (one flattened bucket) lands exactly."""
    a, b, expected = models
    engine.update_weights_from_disk(a)
    group = _join(engine, 2, "g2")
    weights = load_hf_weights(b, load_config(b))
    bad = dict(weights, **{"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)})
    ok, message = _push(engine, group, bad, "g2")
    assert not ok and "model.layers.0.mlp.up_proj.weight" in message and "does not fit" in message
    assert _greedy(engine) == expected["a"]
    ok, message = _push(engine, group, {n: t.to(torch.bfloat16) for n, t in weights.items()}, "g2",
                        load_format="flattened_bucket")
    assert ok, message
    bf16_b = _greedy(engine)
    engine.update_weights_from_disk(a)
    assert _push(engine, group, {n: t.to(torch.bfloat16) for n, t in weights.items()}, "g2")[0]
    assert _greedy(engine) == bf16_b  # one buffer or one broadcast a tensor: the same weights
    assert engine.destroy_weights_update_group("g2")[0]


def test_pause_retract_keeps_a_stream_and_continue_finishes_it(engine):
    sp = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}
    plain = engine.generate(input_ids=[9, 8, 7], sampling_params=sp)
    chunks: list = []
    streaming = threading.Thread(target=lambda: chunks.extend(
        engine.generate(input_ids=[9, 8, 7], sampling_params=sp, stream=True)))
    streaming.start()
    while not chunks and streaming.is_alive():
        time.sleep(0.01)
    assert engine.pause_generation("retract") == 1
    assert engine.get_server_info()["paused"]
    time.sleep(0.3)
    held = len(chunks)
    time.sleep(0.3)
    assert len(chunks) == held and streaming.is_alive()  # nothing runs while paused
    engine.continue_generation()
    streaming.join(120)
    last = chunks[-1]
    assert last["output_ids"] == plain["output_ids"] and last["meta_info"]["num_retractions"] >= 1


def test_pause_abort_ends_running_requests(engine):
    sp = {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}
    chunks: list = []
    running = threading.Thread(target=lambda: chunks.extend(
        engine.generate(input_ids=[3, 4], sampling_params=sp, stream=True)))
    running.start()
    while not chunks and running.is_alive():
        time.sleep(0.01)
    assert engine.pause_generation("abort") == 1
    running.join(60)
    engine.continue_generation()
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort" and len(chunks[-1]["output_ids"]) < 2000
    assert len(engine.generate(input_ids=[3, 4], sampling_params=GREEDY)["output_ids"]) == 8


def test_update_over_a_trainers_group_under_tp_2(models):
    """World size 3: the trainer and two TP ranks; each rank takes its shard of every broadcast."""
    a, b, expected = models
    weights = load_hf_weights(b, load_config(b))
    with Engine(a, tp_size=2, max_total_tokens=4000, max_running_requests=4, log_level="warning") as tp2:
        ok, message = _push(tp2, _join(tp2, 3, "t"), weights, "t")
        assert ok, message
        with _engine(b) as fresh_b_tp1:  # the reference: B itself, served at TP 1 in this dtype
            reference = _greedy(fresh_b_tp1)
            # whole tensors gathered from the ranks' shards: rows (q of the fused qkv, the vocab), input
            # columns (o_proj, row-parallel) and a replicated norm, each as TP 1 holds it
            names = [Q0, "model.layers.1.self_attn.o_proj.weight", "model.embed_tokens.weight",
                     "model.layers.0.input_layernorm.weight"]
            whole = {name: fresh_b_tp1.get_weights_by_name(name, truncate_size=10**6) for name in names}
        assert _greedy(tp2) == reference
        for name in names:
            got = tp2.get_weights_by_name(name, truncate_size=10**6)
            assert got == whole[name] and len(got) == weights[name].shape[0], name


def _scheduler_rss_bytes(engine: Engine) -> int:
    pid = engine.get_server_info()["scheduler_pid"]
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_release_and_resume_memory_occupation(engine, models):
    """The scheduler gives the KV pool and the weights back (its RSS drops by about their size),
    requests wait meanwhile, and after resume the answers are those of the weights on disk."""
    a, b, expected = models
    engine.update_weights_from_disk(a)
    before = _scheduler_rss_bytes(engine)
    ok, message = engine.release_memory_occupation()
    assert ok, message
    after = _scheduler_rss_bytes(engine)
    assert engine.get_server_info()["memory_released"] == ["kv_cache", "weights"]
    # the tiny Qwen2's untied embedding and head alone are 2 x 49152 x 64 bf16 values (12.6 MB)
    assert before - after > 10e6, (before, after)
    assert not engine.update_weights_from_disk(b)[0]  # no weights to update until they are resumed
    result: dict = {}
    waiting = threading.Thread(target=lambda: result.update(ids=_greedy(engine)))
    waiting.start()
    time.sleep(0.5)
    assert waiting.is_alive()  # nothing runs while the memory is released
    ok, message = engine.resume_memory_occupation()
    assert ok, message
    waiting.join(60)
    assert result["ids"] == expected["a"] and engine.get_server_info()["memory_released"] == []


@pytest.mark.parametrize("abort_all", [False, True])
def test_an_update_under_traffic_lets_every_request_end_as_its_mode_says(engine, models, abort_all):
    """16 requests in flight when the update comes: without abort_all_requests each finishes (on the
    old weights: the update waits for them), with it each running one ends aborted; none hangs,
    and the strict leak check (every test scheduler raises on KV held while idle) stays quiet."""
    a, b, expected = models
    engine.update_weights_from_disk(a)
    sp = {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True}
    results: list = []
    started = threading.Event()

    def client(i: int) -> None:
        for chunk in engine.generate(input_ids=[7, i + 1, 9], sampling_params=sp, stream=True):
            started.set()
            last = chunk
        results.append(last)

    clients = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for c in clients:
        c.start()
    started.wait(30)
    ok, message = engine.update_weights_from_disk(b, abort_all_requests=abort_all)
    assert ok, message
    for c in clients:
        c.join(120)
    assert len(results) == 16 and not any(c.is_alive() for c in clients)
    reasons = {r["meta_info"]["finish_reason"]["type"] for r in results}
    assert reasons == ({"abort", "length"} if abort_all else {"length"}) or (abort_all and reasons == {"abort"})
    if not abort_all:
        assert all(len(r["output_ids"]) == 300 for r in results)
    assert _greedy(engine) == expected["b"]
    info = engine.get_server_info()
    assert info["num_running_reqs"] == 0 and info["kv_slots_used"] == 0
