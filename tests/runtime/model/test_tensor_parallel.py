"""Tensor parallelism at the model level: gloo ranks (child processes) give TP=1's greedy tokens
and logits, on tiny models split in two and on SmolLM2 split in three (its 9 query / 3 KV heads
allow no other split); a prompt at TP 2 gets the same bits alone or batched; the weight split and
its refusals, without processes."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from tandem.kernels.cpu_ops import load_cpu_ops
from tandem.launch.bare_loop import BareLoop
from tandem.runtime.model.config import ModelConfig
from tandem.runtime.model import packed_linear
from tandem.runtime.model.runner import ModelRunner
from tandem.runtime.model.tensor_parallel import TensorParallel, check_divisible, shard_weights
from tandem.runtime.server_args import ServerArgs
from tp_runner import PROMPTS, assert_tp2_equals_tp1, free_addr, run_tp


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # tied embeddings; an LM head and qkv bias
def test_tp2_equals_tp1(tiny_model_dir, tmp_path, arch):
    assert_tp2_equals_tp1(tiny_model_dir(arch), str(tmp_path / "tp2.pt"))


@pytest.mark.timeout(400)
def test_smollm2_tp3_equals_tp1(tmp_path):
    ref = BareLoop(ModelRunner(ServerArgs(max_total_tokens=600, max_running_requests=4, dtype="float32",
                                          quantization="none"))
                   ).generate(PROMPTS, 10, keep_logits=True)
    got = run_tp(None, 3, str(tmp_path / "tp3.pt"))
    assert got["ids"] == ref.output_ids
    for a, b in zip(ref.step_logits, got["logits"]):
        assert (a - b).abs().max().item() < 1e-3  # fp32 over 30 layers, logits ~30: the bound vs transformers


def test_shards_put_back_together_give_the_checkpoint():
    cfg = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 4,
                                    "intermediate_size": 6, "num_hidden_layers": 1, "num_attention_heads": 4,
                                    "num_key_value_heads": 2, "head_dim": 1})
    weights = {"layers.0.self_attn.qkv_proj.weight": torch.arange(8 * 4.).view(8, 4),
               "layers.0.self_attn.o_proj.weight": torch.arange(16.).view(4, 4),
               "layers.0.mlp.gate_up_proj.weight": torch.arange(48.).view(12, 4),
               "layers.0.mlp.down_proj.weight": torch.arange(24.).view(4, 6),
               "embed_tokens.weight": torch.arange(32.).view(8, 4), "norm.weight": torch.ones(4)}
    shards = [shard_weights(weights, cfg, TensorParallel(rank, 2)) for rank in (0, 1)]
    qkv = [s["layers.0.self_attn.qkv_proj.weight"] for s in shards]
    # rank r: query heads 2r, 2r+1 (rows 0-3 are q), KV head r of k (rows 4-5) and of v (rows 6-7)
    assert torch.equal(qkv[1], weights["layers.0.self_attn.qkv_proj.weight"][[2, 3, 5, 7]])
    gate_up = [s["layers.0.mlp.gate_up_proj.weight"] for s in shards]
    assert torch.equal(gate_up[0], weights["layers.0.mlp.gate_up_proj.weight"][[0, 1, 2, 6, 7, 8]])
    assert torch.equal(torch.cat([s["layers.0.mlp.down_proj.weight"] for s in shards], dim=1),
                       weights["layers.0.mlp.down_proj.weight"])
    assert torch.equal(torch.cat([s["embed_tokens.weight"] for s in shards]), weights["embed_tokens.weight"])
    assert all(torch.equal(s["norm.weight"], weights["norm.weight"]) for s in shards)


def test_uneven_heads_are_refused_naming_the_counts():
    smollm2 = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 49152,
                                        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                                        "num_attention_heads": 9, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match=r"--tp-size 2 does not divide the model's query heads and KV heads "
                                         r"\(it has 9 query heads, 3 KV heads"):
        check_divisible(smollm2, 2)
    check_divisible(smollm2, 3)


def test_joining_says_what_it_waits_for(caplog):
    """A node whose peers never start waits in the rendezvous: its log says where and for how
    many ranks, and when the wait is over."""
    from tandem.runtime.model.tensor_parallel import init_tensor_parallel

    addr = free_addr()
    with caplog.at_level("INFO", logger="tandem.runtime.model.tensor_parallel"):
        tp, _ = init_tensor_parallel(0, 1, addr, torch.device("cpu"))
    try:
        assert tp.rank == 0 and tp.size == 1
        assert [r.getMessage() for r in caplog.records] == [
            f"TP rank 0: waiting at {addr} for all 1 ranks to join (gloo)", "TP rank 0: all 1 ranks joined"]
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.timeout(120)
def test_dist_timeout_bounds_the_wait_for_a_rank_that_never_joins():
    """--dist-timeout, as SGLang's: a rank whose peer never starts fails after that many seconds
    instead of torch's 30 minutes (in a child: a failed join leaves torch.distributed's state)."""
    script = textwrap.dedent("""
        import sys, time, torch
        from tandem.runtime.model.tensor_parallel import init_tensor_parallel
        start = time.monotonic()
        try:
            init_tensor_parallel(0, 2, sys.argv[1], torch.device("cpu"), timeout_s=3)
        except (TypeError, ValueError):
            raise  # a call the function does not take is not the timeout this test is about
        except Exception as exc:
            print("refused after", round(time.monotonic() - start), "s:", type(exc).__name__)
            sys.exit(3)
    """)
    # the run's own timeout (100 s, against torch's 30 minutes) is what shows the wait was bounded
    proc = subprocess.run([sys.executable, "-c", script, free_addr()], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 3 and "refused after" in proc.stdout, (proc.stdout, proc.stderr[-2000:])


INVARIANCE_SCRIPT = textwrap.dedent("""
    import sys, torch
    from tandem.launch.bare_loop import BareLoop
    from tandem.runtime.model.runner import ModelRunner
    from tandem.runtime.model.tensor_parallel import init_tensor_parallel
    from tandem.runtime.server_args import ServerArgs
    path, addr, rank, size, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    tp, _ = init_tensor_parallel(rank, size, addr, torch.device("cpu"))
    args = ServerArgs(model_path=path, max_total_tokens=600, max_running_requests=4, dtype=sys.argv[6], tp_size=size)
    loop = BareLoop(ModelRunner(args, tp))
    together = loop.generate({prompts}, 10, keep_logits=True)
    alone = [loop.generate([p], 10, keep_logits=True) for p in {prompts}]
    if rank == 0:
        torch.save({{"together": (together.output_ids, together.step_logits),
                    "alone": [(a.output_ids, a.step_logits) for a in alone]}}, out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
""")


def _amx() -> bool:
    ops = load_cpu_ops()
    return ops is not None and ops.amx_available()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", [
    pytest.param("float32", marks=pytest.mark.skipif(
        packed_linear.fp32_layout()[0] != "mkl",
        reason="fp32 linears are batch-invariant on MKL's packed GEMM (Intel CPUs); oneDNN's are not")),
    pytest.param("bfloat16", marks=pytest.mark.skipif(
        not _amx(), reason="bf16 linears are batch-invariant on the AMX kernel; this CPU gives no AMX")),
])
def test_tp2_gives_a_prompt_the_same_bits_alone_or_batched(tiny_model_dir, tmp_path, dtype):
    """At a fixed --tp-size the invariances hold: each rank's matmuls and attention are row-wise
    fixed reductions and the all-reduce sums the same two partials for a row in any batch."""
    addr, out = free_addr(), str(tmp_path / "inv.pt")
    script = INVARIANCE_SCRIPT.format(prompts=PROMPTS)
    procs = [subprocess.Popen([sys.executable, "-c", script, tiny_model_dir("llama"), addr, str(rank), "2", out, dtype],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    try:
        logs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-3000:]
    got = torch.load(out)
    ids, logits = got["together"]
    for i, (alone_ids, alone_logits) in enumerate(got["alone"]):
        assert alone_ids[0] == ids[i]
        assert all(torch.equal(a[0], b[i]) for a, b in zip(alone_logits, logits))
