"""build_truncated_model: the draft's config says what the source's said, so it loads and rotates alike."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tandem.launch.make_tiny_model import build_truncated_model
from tandem.runtime.model.loader import load_config, load_model


def test_a_truncated_copy_keeps_mlp_biases_and_a_linear_rope_scaling(tiny_model_dir, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_model_dir("llama"), src)
    config = json.loads((src / "config.json").read_text())
    config.pop("rope_parameters", None)  # the older layout, which the draft's config is written in
    config.update(mlp_bias=True, rope_theta=1e5, rope_scaling={"rope_type": "linear", "factor": 2.0})
    (src / "config.json").write_text(json.dumps(config))
    weights = load_file(str(src / "model.safetensors"))
    for layer in range(config["num_hidden_layers"]):
        for proj, width in (("gate", config["intermediate_size"]), ("up", config["intermediate_size"]),
                            ("down", config["hidden_size"])):
            weights[f"model.layers.{layer}.mlp.{proj}_proj.bias"] = torch.randn(width)
    save_file(weights, str(src / "model.safetensors"))

    draft = build_truncated_model(str(src), tmp_path / "draft", 1)
    want, got = load_config(str(src)), load_config(str(draft))
    assert got.mlp_bias and got.rope_scaling == want.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert got.rope_theta == want.rope_theta == 1e5
    assert got.max_position == want.max_position == 2 * 2048  # stretched once, not twice
    model = load_model(str(draft), torch.float32)
    assert model.layers[0].mlp.down_proj_bias is not None


def test_a_copy_in_bfloat16_holds_every_layer_rounded_once(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama")
    layers = load_config(src).num_layers
    copy = build_truncated_model(src, tmp_path / "bf16", layers, "bfloat16")
    got, want = load_file(str(copy / "model.safetensors")), load_file(str(Path(src) / "model.safetensors"))
    assert json.loads((copy / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert got.keys() == want.keys()
    assert all(got[n].dtype == torch.bfloat16 and torch.equal(got[n], want[n].float().to(torch.bfloat16)) for n in got)
