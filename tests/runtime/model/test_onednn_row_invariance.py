"""oneDNN's linears keep a row's bits among any rows on the CPUs tandem cannot run here: oneDNN's fp32
kernels are checked with its instruction set capped (ONEDNN_MAX_CPU_ISA) at AVX2 (what an AMD Zen 2/3
runs), AVX-512 without bf16 and AVX-512 with bf16 (a Zen 4), as tandem packs them off Intel
(`fp32_layout` = onednn) for the linears and the LM head, and oneDNN's bf16 kernels without AMX: a row alone (computed as MIN_ROWS rows) and
the same row among 2..300 others or at 1 and 2 threads give equal bits. The cap is read when oneDNN
starts, so each runs in its own process. Shapes: SmolLM2's (576 wide, 1536 MLP, 49152 vocab) and a
7B Llama's MLP (4096 -> 11008 -> 4096)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(600)

_PROBE = r"""
import json, torch
from tandem.runtime.model import packed_linear as pl
pl.cpu_vendor = lambda: "AuthenticAMD"  # fp32_head packs as off Intel
shapes = [(576, 960), (576, 3072), (1536, 576), (576, 49152), (4096, 11008), (11008, 4096)]
rows, picked = [2, 3, 7, 16, 17, 33, 64, 65, 300], (0, 1, 16)
failures = []
g = torch.Generator().manual_seed(0)
dtypes = [torch.float32] + ([torch.bfloat16] if BF16 else [])
for k, n, dtype in [(k, n, dtype) for k, n in shapes for dtype in dtypes]:
    weight = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    runs = {"linear": (lambda w: lambda a: pl.linear(a, w))(torch.ops.mkldnn._reorder_linear_weight(weight, None))}
    if n == 49152 and dtype == torch.float32:
        runs["head"] = (lambda h: lambda a: pl.head_logits(a, h))(pl.fp32_head(torch.randn(n, k, generator=g) / k ** 0.5))
    x = torch.randn(max(rows), k, generator=g).to(dtype)
    for name, run in runs.items():
        one_thread = None
        for threads in (1, 2):
            torch.set_num_threads(threads)
            alone = [run(x[i:i + 1]) for i in picked]
            one_thread = one_thread or alone
            if not all(torch.equal(a, b) for a, b in zip(alone, one_thread)):
                failures.append([k, n, name, "1 vs 2 threads"])
            for m in rows:
                out = run(x[:m])
                failures += [[k, n, name, threads, m, i] for j, i in enumerate(picked)
                             if i < m and not torch.equal(out[i:i + 1], alone[j])]
print(json.dumps(failures))
"""


@pytest.mark.parametrize("isa", ["AVX2", "AVX512_CORE", "AVX512_CORE_BF16"])
def test_onednn_fp32_rows_are_invariant_with_the_isa_capped(isa):
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA=isa)
    # bf16 too where the capped ISA has it natively (a CPU with AVX512-BF16 and no AMX)
    probe = f"BF16 = {isa == 'AVX512_CORE_BF16'}\n" + _PROBE
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=540,
                         cwd=os.path.dirname(os.path.abspath(__file__)))
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
