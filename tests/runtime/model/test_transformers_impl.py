"""--model-impl transformers on tiny random architectures tandem has no class for (GPT-NeoX with
partial rotary and parallel residual, Phi-3 with fused projections and grouped KV heads): greedy
equals transformers' own generate, logprobs match its log_softmax, a chunked or cached prefill
computes the bits a whole one does; --model-impl auto/sglang choose as SGLang's do; and what this
cannot serve is refused at load, naming why."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.launch.bare_loop import BareLoop
from tandem.runtime.model.llama import CausalLM
from tandem.runtime.model.runner import ModelRunner
from tandem.runtime.model.tensor_parallel import TensorParallel
from tandem.runtime.model.transformers_impl import TransformersCausalLM, load_transformers_model
from tandem.runtime.server_args import ServerArgs
from tiny_transformers_models import build_tiny_transformers_model

pytestmark = pytest.mark.timeout(600)

ARCHS = ["gpt_neox", "phi3"]
# Phi-3 with an 8-key sliding window: transformers hands it to attention as `sliding_window`
_VARIANTS = {"phi3_window": ("phi3", {"sliding_window": 8})}
PROMPTS = [list(range(200, 207)), list(range(1000, 1040)), [5, 17, 300, 4000, 12, 9]]
MAX_NEW = 16
# fp32, the same weights: tandem's attention (the C++ op) and fp32 head sum in other orders than
# transformers' eager attention and plain linear; on logits of magnitude ~5 that is ~1e-6
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_transformers")
    def path(name: str) -> str:
        arch, overrides = _VARIANTS.get(name, (name, {}))
        return str(build_tiny_transformers_model(root / name, arch, **overrides))
    return path


@pytest.fixture(scope="module")
def runner(tiny_path):
    made: dict[str, ModelRunner] = {}

    def make(arch: str) -> ModelRunner:
        if arch not in made:
            made[arch] = ModelRunner(ServerArgs(model_path=tiny_path(arch), max_total_tokens=2048,
                                                max_running_requests=8, dtype="float32"))
        return made[arch]
    return make


def _hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf_greedy(hf, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          do_sample=False, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("arch", [*ARCHS, "phi3_window"])
def test_auto_runs_transformers_and_greedy_equals_generate(runner, tiny_path, arch):
    r = runner(arch)
    assert isinstance(r.model, TransformersCausalLM)  # auto: tandem has no class of its own for it
    hf = _hf(tiny_path(arch))
    ours = BareLoop(r).generate(PROMPTS, MAX_NEW).output_ids
    assert ours == [_hf_greedy(hf, ids) for ids in PROMPTS]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_other_attention_backends_greedy_equals_generate(tiny_path, backend):
    """The torch (reference) and triton (GPU; its interpreter here) backends behind the same
    interface, on the windowed Phi-3: the window reaches each backend."""
    path = tiny_path("phi3_window")
    r = ModelRunner(ServerArgs(model_path=path, max_total_tokens=1024, max_running_requests=4, dtype="float32",
                               attention_backend=backend))
    hf = _hf(path)
    assert BareLoop(r).generate(PROMPTS[:2], MAX_NEW).output_ids == [_hf_greedy(hf, ids) for ids in PROMPTS[:2]]


@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_match_transformers_log_softmax(runner, tiny_path, arch):
    r = runner(arch)
    ids = PROMPTS[1]
    loop = BareLoop(r)
    row = r.req_to_token_pool.alloc()
    try:
        ours = torch.log_softmax(loop.prefill([ids], [row], all_logits=True).float(), -1)
    finally:
        loop.release([row], [len(ids)])
    with torch.no_grad():
        want = torch.log_softmax(_hf(tiny_path(arch))(torch.tensor([ids])).logits[0].float(), -1)
    assert (ours - want).abs().max().item() < LOGPROB_ATOL


@pytest.mark.parametrize("arch", ARCHS)
def test_cached_prefix_and_batch_neighbour_change_no_bit(runner, arch):
    """A prompt extended over its cached first 13 tokens, beside another request, gives the logits
    its whole prefill gave, bit for bit (what makes radix hits and retraction answer alike)."""
    r = runner(arch)
    loop = BareLoop(r)
    ids, other = PROMPTS[1], list(range(900, 917))
    rows = [r.req_to_token_pool.alloc() for _ in range(3)]
    try:
        whole = loop.prefill([ids], [rows[0]], all_logits=True)
        loop.prefill([ids[:13]], [rows[1]])
        both = loop.prefill([other, ids], [rows[2], rows[1]], prefix_lens=[0, 13], all_logits=True)
    finally:
        loop.release(rows, [len(ids), len(ids), len(other)])
    assert torch.equal(whole[13:], both[len(other):])


def test_bf16_model_probed_in_fp32_is_served_in_bf16(tiny_path):
    """The load-time probe widens the model to fp32 (16-bit rounding is not what it checks) and
    narrows every weight back: the served model holds bf16 only, its head made from those."""
    model = load_transformers_model(tiny_path("phi3"), torch.bfloat16)
    assert {p.dtype for p in model.hf.parameters()} == {torch.bfloat16}
    assert model._head_fp32 is None


def test_transformers_impl_of_a_native_arch_answers_as_the_native_class(tiny_model_dir):
    path = tiny_model_dir("llama")
    runs = {}
    for impl in ("auto", "transformers"):
        r = ModelRunner(ServerArgs(model_path=path, max_total_tokens=1024, max_running_requests=4, dtype="float32",
                                   model_impl=impl))
        runs[impl] = r
    assert isinstance(runs["auto"].model, CausalLM) and isinstance(runs["transformers"].model, TransformersCausalLM)
    outs = {impl: BareLoop(r).generate(PROMPTS, MAX_NEW).output_ids for impl, r in runs.items()}
    assert outs["transformers"] == outs["auto"]


def test_sglang_impl_refuses_what_tandem_has_no_class_for(tiny_path):
    with pytest.raises(ValueError, match="unsupported model architecture 'GPTNeoXForCausalLM'"):
        ModelRunner(ServerArgs(model_path=tiny_path("gpt_neox"), max_total_tokens=256, dtype="float32",
                               model_impl="sglang"))


def test_gguf_and_tensor_parallel_refused(tiny_path):
    from tandem.runtime.model.transformers_checks import uses_transformers
    from tandem.runtime.model_files import default_model_path

    with pytest.raises(ValueError, match="GGUF file"):
        uses_transformers("transformers", default_model_path())
    assert not uses_transformers("auto", default_model_path())
    with pytest.raises(ValueError, match="--tp-size 2"):
        load_transformers_model(tiny_path("gpt_neox"), torch.float32, tp=TensorParallel(rank=0, size=2, group=None))


def test_bad_model_impl_names_the_flag():
    with pytest.raises(ValueError, match="--model-impl: 'hf'"):
        ServerArgs(model_impl="hf")


def _save(tmp_path, config, name: str) -> str:
    """A tiny random checkpoint of `config` (transformers' default init), tokenizer included."""
    import transformers

    from tandem.runtime.tokenizer import load_tokenizer

    out = tmp_path / name
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(out))
    load_tokenizer(None).save_pretrained(str(out))
    return str(out)


_SHARED = dict(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8)


@pytest.mark.parametrize("name, make, reason", [
    ("mamba", lambda t: t.MambaConfig(vocab_size=49152, hidden_size=32, num_hidden_layers=2), "recurrent or state-space"),
    ("stablelm", lambda t: t.StableLmConfig(**{k: v for k, v in _SHARED.items() if k != "head_dim"}),
     "does not support a custom attention backend"),
    ("gemma2", lambda t: t.Gemma2Config(**_SHARED, attn_logit_softcapping=50.0), "attention-score softcapping"),
    # transformers scales Granite's logits after the head: the load-time probe sees tandem's differ
    ("granite", lambda t: t.GraniteConfig(**_SHARED, logits_scaling=4.0), "differ from transformers' own"),
])
def test_unservable_models_refused_at_load_naming_why(tmp_path, name, make, reason):
    import transformers

    path = _save(tmp_path, make(transformers), name)
    with pytest.raises(ValueError, match=reason):
        ModelRunner(ServerArgs(model_path=path, max_total_tokens=256, dtype="float32", model_impl="transformers"))


def test_linear_attention_layer_types_refused(tiny_path, tmp_path):
    import shutil

    path = shutil.copytree(tiny_path("phi3"), tmp_path / "hybrid")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"layer_types": ["full_attention", "linear_attention"]}))
    with pytest.raises(ValueError, match="'linear_attention' layers"):
        load_transformers_model(str(path), torch.float32)


def test_checkpoint_lacking_a_weight_refused(tiny_path, tmp_path):
    import shutil

    path = shutil.copytree(tiny_path("gpt_neox"), tmp_path / "cut")
    (file,) = path.glob("*.safetensors")
    weights = load_file(str(file))
    dropped = next(name for name in weights if name.endswith("mlp.dense_4h_to_h.weight"))
    del weights[dropped]
    save_file(weights, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="checkpoint lacks weights"):
        load_transformers_model(str(path), torch.float32)
