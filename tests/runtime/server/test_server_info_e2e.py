"""/server_info's SGLang fields that clients and gateways read."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(300)


def test_server_info_reports_the_weight_version_as_model_info_and_meta_info_do(tiny_server):
    info = tiny_server.info()
    model = tiny_server.get("/model_info").json()
    out = tiny_server.generate({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}})
    assert info["weight_version"] == model["weight_version"] == out["meta_info"]["weight_version"] == "default"
    assert info["dp_size"] == 1 and info["version"]
    assert info["weight_quantization"] == "none" and info["weight_bytes"] > 0  # the tiny model in --dtype
