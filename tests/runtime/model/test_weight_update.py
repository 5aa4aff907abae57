"""Weight updates in place (runtime/model/weight_update.py): checkpoint B written into a served
model A gives exactly B's parameters, packed or not, in whole or in part, and a name or shape
that does not fit changes nothing."""
from __future__ import annotations

import pytest
import torch

from tandem.launch.make_tiny_model import build_tiny_model
from tandem.runtime.model import weight_update
from tandem.runtime.model.loader import load_config, load_hf_weights, load_model
from tandem.runtime.model.packed_linear import PackedLinear
from tandem.runtime.model.tensor_parallel import SINGLE

ARCHS = ["qwen2", "qwen3_moe"]  # biases on q, k and v; stacked experts


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("weight_update")
    return {arch: (str(build_tiny_model(root / f"{arch}_a", arch, seed=0)),
                   str(build_tiny_model(root / f"{arch}_b", arch, seed=1))) for arch in ARCHS}


def _served(path: str, dtype: torch.dtype):
    model = load_model(path, dtype)
    model.pack_weights()  # the CPU's packed layout where this dtype has one: updates must go through it
    return model


def _all(model) -> dict[str, torch.Tensor]:
    return {name: weight_update.read(model, name) for name in weight_update.shapes(model)}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checkpoint_b_into_model_a_gives_b(pair, arch, dtype):
    a_path, b_path = pair[arch]
    model, fresh_b, cfg = _served(a_path, dtype), _served(b_path, dtype), load_config(b_path)
    assert any(isinstance(m, PackedLinear) for m in model.modules())  # (this CPU packs both dtypes)
    checked = weight_update.check(model, cfg, SINGLE, load_hf_weights(b_path, cfg).items())
    changed = weight_update.apply(model, checked)
    want, got = _all(fresh_b), _all(model)
    assert changed == len(want) and want.keys() == got.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert torch.equal(_head_bits(model), _head_bits(fresh_b))  # the LM head's own copy follows the new head


def _head_bits(model) -> torch.Tensor:
    """The logits the model's LM head (its own fp32-logits copy of the head weight) gives fixed hidden states."""
    hidden = torch.randn(3, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    return model.logits(hidden.to(model.norm.weight.dtype))


def test_a_broadcast_that_fails_part_way_changes_nothing(pair, monkeypatch):
    """The scheduler's broadcast update (weights_control) receives every tensor before the first
    write: a trainer gone after some of them leaves A serving, every bit and the LM head's copy."""
    from types import SimpleNamespace

    from tandem.ipc.messages import WeightsReq
    from tandem.runtime.scheduler import weights_control

    a_path, b_path = pair["qwen2"]
    model, cfg = _served(a_path, torch.bfloat16), load_config(b_path)
    before, head_before = _all(model), _head_bits(model)
    tensors = {n: t.to(torch.bfloat16) for n, t in load_hf_weights(b_path, cfg).items()}

    def receive(group, specs, device, flattened=False):  # half the broadcasts arrived, then the trainer left
        raise ConnectionResetError("the trainer went away")
    monkeypatch.setattr(weights_control, "receive", receive)
    runner = SimpleNamespace(model=model, config=cfg, tp=SINGLE, device=torch.device("cpu"))
    control = weights_control.WeightsControl(runner, worker=None)
    control.groups["g"] = object()
    msg = WeightsReq(req_id=1, op="update_from_distributed", names=list(tensors), group_name="g",
                     dtypes=["bfloat16"] * len(tensors), shapes=[list(t.shape) for t in tensors.values()])
    with pytest.raises(ConnectionResetError):
        control._update_from_distributed(msg)
    assert all(torch.equal(t, before[n]) for n, t in _all(model).items())
    assert torch.equal(_head_bits(model), head_before)


def test_reading_a_packed_weight_gives_the_loaded_bits(pair):
    path = pair["qwen2"][0]
    plain, packed = load_model(path, torch.bfloat16), _served(path, torch.bfloat16)
    name = "layers.1.mlp.gate_up_proj.weight"
    assert isinstance(packed.get_submodule("layers.1.mlp.gate_up_proj"), PackedLinear)
    assert torch.equal(weight_update.read(packed, name), dict(plain.named_parameters())[name])


def test_one_projection_updates_only_its_rows_of_the_fused_weight(pair):
    a_path, b_path = pair["qwen2"]
    cfg = load_config(a_path)
    model = _served(a_path, torch.float32)
    before = weight_update.read(model, "layers.0.self_attn.qkv_proj.weight")
    k_b = load_hf_weights(b_path, cfg)["model.layers.0.self_attn.k_proj.weight"]
    weight_update.apply(model, weight_update.check(model, cfg, SINGLE, [("model.layers.0.self_attn.k_proj.weight", k_b)]))
    after = weight_update.read(model, "layers.0.self_attn.qkv_proj.weight")
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    assert torch.equal(after[q:q + kv], k_b) and torch.equal(after[:q], before[:q])
    assert torch.equal(after[q + kv:], before[q + kv:])


@pytest.mark.parametrize("name, shape, message", [
    ("model.layers.0.self_attn.k_proj.weight", (7, 64), "does not fit"),
    ("model.layers.9.self_attn.k_proj.weight", (32, 64), "no such weight"),
    ("model.layers.0.mlp.up_proj.weight", None, "not a floating-point"),
])
def test_a_weight_that_does_not_fit_is_refused_by_name_and_nothing_changes(pair, name, shape, message):
    a_path, _ = pair["qwen2"]
    cfg = load_config(a_path)
    model = _served(a_path, torch.float32)
    before = _all(model)
    good = ("model.layers.1.self_attn.o_proj.weight", torch.zeros(64, 64))
    bad = torch.zeros(shape) if shape else torch.zeros(128, 64, dtype=torch.int32)
    with pytest.raises(ValueError, match=message) as err:
        weight_update.check(model, cfg, SINGLE, [good, (name, bad)])
    assert name in str(err.value)
    assert all(torch.equal(t, before[n]) for n, t in _all(model).items())
