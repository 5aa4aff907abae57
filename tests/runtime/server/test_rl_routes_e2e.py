"""SGLang's training-loop routes over HTTP: an update from disk answers with SGLang's body and sets
the weight version everywhere it shows; bad bodies are 400s naming the field; while generation is
paused /health_generate says so and /server_info shows it."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(300)
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def test_update_from_disk_over_http_sets_the_version(servers, tiny_model_dir):
    server = servers("tiny_rl")
    before = server.generate({"input_ids": [5, 6, 7, 8], "sampling_params": GREEDY})
    assert before["meta_info"]["weight_version"] == "v0" == server.info()["weight_version"]
    reply = server.post("/update_weights_from_disk", {"model_path": tiny_model_dir("llama"), "weight_version": "v1"})
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"success": True, "message": reply.json()["message"], "num_paused_requests": 0}
    after = server.generate({"input_ids": [5, 6, 7, 8], "sampling_params": GREEDY})
    assert after["output_ids"] == before["output_ids"] and after["meta_info"]["cached_tokens"] == 0
    assert after["meta_info"]["weight_version"] == "v1" == server.get("/model_info").json()["weight_version"]
    q = server.post("/get_weights_by_name", {"name": "model.layers.0.self_attn.q_proj.weight", "truncate_size": 2})
    assert q.status_code == 200 and len(q.json()) == 2 and len(q.json()[0]) == 64


@pytest.mark.parametrize("path, body, field", [
    ("/update_weights_from_disk", {}, "model_path"),
    ("/update_weights_from_disk", {"model_path": "/x", "flush_cache": "no"}, "flush_cache"),
    ("/update_weights_from_disk", {"model_path": "/x", "keep_pause": True}, "keep_pause"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": "%%%"}, "serialized_named_tensors"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["bfloat16"], "shapes": []}, "shapes"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["int8"], "shapes": [[1]]}, "dtypes[0]"),
    ("/init_weights_update_group", {"master_address": "h", "master_port": 0, "rank_offset": 1, "world_size": 2},
     "master_port"),
    ("/pause_generation", {"mode": "later"}, "mode"),
    ("/release_memory_occupation", {"tags": ["gpu"]}, "tags"),
    ("/update_weight_version", {"new_version": 3}, "new_version"),
])
def test_bad_bodies_are_400s_naming_the_field(servers, path, body, field):
    reply = servers("tiny_rl").post(path, body)
    assert reply.status_code == 400 and reply.json()["error"]["message"].startswith(field), reply.text


def test_a_refused_update_is_a_400_with_sglangs_body(servers, tmp_path):
    reply = servers("tiny_rl").post("/update_weights_from_disk", {"model_path": str(tmp_path)})
    assert reply.status_code == 400 and reply.json()["success"] is False and str(tmp_path) in reply.json()["message"]


def test_pause_shows_in_health_and_server_info_until_continue(servers):
    server = servers("tiny_rl")
    try:
        reply = server.post("/pause_generation", {"mode": "in_place"})
        assert reply.status_code == 200 and reply.json()["message"] == "Generation paused successfully."
        assert server.get("/health_generate").status_code == 503 and server.info()["paused"] is True
    finally:
        assert server.post("/continue_generation").status_code == 200
    assert server.get("/health_generate").status_code == 200 and server.info()["paused"] is False
