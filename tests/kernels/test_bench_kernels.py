"""The kernel benchmark's check-only path (runs on CPU under the interpreter), its table helpers,
and (on a GPU) its timing rows for the grammar bitmask, the fused MoE and the quantized linears."""
from __future__ import annotations

import pytest
import torch

from tandem.launch import bench_kernels


def test_check_only_passes(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_kernels.main(["--check-only"]) == 0
    assert "checks passed" in capsys.readouterr().out


def test_check_only_fails_on_a_wrong_kernel(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from tandem.kernels import norm

    monkeypatch.setattr(norm, "rmsnorm", lambda x, w, eps: norm.rmsnorm_ref(x, w, eps) + 1)
    assert bench_kernels.main(["--check-only"]) == 1
    assert "FAIL rmsnorm" in capsys.readouterr().out


def test_check_only_covers_the_token_bitmask_the_fused_moe_and_the_quantized_linears(tmp_path) -> None:
    """The kernels against their references (kernels/reference.py, kernels/moe_reference.py,
    kernels/dequant_reference.py) in fp32 and fp16 (the interpreter's bf16 is broken; a GPU adds
    it), and all agree."""
    import json

    out = tmp_path / "kernels.json"
    assert bench_kernels.main(["--check-only", "--output-file", str(out)]) == 0
    checks = json.loads(out.read_text())["checks"]
    for kernel in ("token_bitmask", "fused_moe", "dequant_gemm_w4a16", "dequant_gemm_w8a16"):
        mine = [c for c in checks if c["kernel"] == kernel]
        assert {"float32", "float16"} <= {c["dtype"] for c in mine}, kernel
        assert all(c["ok"] for c in mine), mine
    assert all(c["max_abs_err"] == 0.0 for c in checks if c["kernel"] == "token_bitmask")  # -inf or untouched


@pytest.mark.parametrize("kernel", ["token_bitmask", "fused_moe", "dequant_gemm_w4a16"])
def test_check_only_fails_on_a_wrong_bitmask_moe_or_quantized_linear(kernel: str, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from tandem.kernels import dequant_gemm, fused_moe, token_bitmask
    from tandem.kernels.dequant_reference import dequant_linear_ref
    from tandem.kernels.moe_reference import fused_moe_ref

    if kernel == "token_bitmask":  # masks nothing
        monkeypatch.setattr(token_bitmask, "apply_token_bitmask", lambda logits, bitmask, rows, block=1024: None)
    elif kernel == "fused_moe":  # drops each token's second expert
        monkeypatch.setattr(fused_moe, "fused_moe", lambda x, w13, w2, weights, ids:
                            fused_moe_ref(x, w13, w2, weights[:, :1], ids[:, :1]))
    else:  # ignores the int4 zeros (symmetric zero 8 instead); int8 has none, so its check still passes
        monkeypatch.setattr(dequant_gemm, "dequant_linear", lambda x, qweight, scales, zeros, group_size, bits:
                            dequant_linear_ref(x, qweight, scales, None, group_size, bits))
    assert bench_kernels.main(["--check-only"]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {kernel}" in out and "FAIL rmsnorm" not in out
    assert kernel != "dequant_gemm_w4a16" or "FAIL dequant_gemm_w8a16" not in out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="timing needs a CUDA GPU")
def test_timing_rows_of_the_token_bitmask_the_fused_moe_and_the_quantized_linears(
        capsys: pytest.CaptureFixture[str]) -> None:
    rows = [bench_kernels._bench_token_bitmask(4), bench_kernels._bench_fused_moe(4),
            *bench_kernels._bench_dequant_gemm(4)]
    for row in rows:
        assert row.triton_us > 0 and row.torch_us and row.torch_us > 0 and row.gbytes > 0, row
    assert all(row.tflop > 0 for row in rows[1:])
    assert rows[2].gbytes < rows[3].gbytes  # int4 stores about half int8's bytes
    bench_kernels._print_table(rows, peak=bench_kernels.peak_gbps(torch.cuda.get_device_name(0)))
    out = capsys.readouterr().out
    assert all(name in out for name in ("token_bitmask", "fused_moe", "dequant_w4a16", "dequant_w8a16"))


def test_peak_bandwidth_table_prefers_specific_names() -> None:
    assert bench_kernels.peak_gbps("NVIDIA H200") == 4800.0
    assert bench_kernels.peak_gbps("NVIDIA H100 80GB HBM3") == 3350.0
    assert bench_kernels.peak_gbps("NVIDIA H100 PCIe") == 2000.0
    assert bench_kernels.peak_gbps("Some Future GPU") is None


def test_table_reports_fraction_of_peak(capsys: pytest.CaptureFixture[str]) -> None:
    row = bench_kernels.Row("decode_attention", "bs=1 ctx=1024", triton_us=10.0, torch_us=40.0, sdpa_us=None,
                            gbytes=0.024, tflop=1e-6)
    bench_kernels._print_table([row], peak=4800.0)
    line = capsys.readouterr().out.splitlines()[1].split()
    assert line[-4:] == ["4.00", "2400", "50.0", "0.1"]  # x torch, GB/s, %peak, TFLOP/s


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit path; on a GPU the timing runs instead")
def test_timing_without_gpu_exits_2() -> None:
    assert bench_kernels.main([]) == 2


@pytest.mark.parametrize("flag", ["--output-file", "--json"])
def test_check_only_writes_its_rows_to_the_output_file(tmp_path, flag: str) -> None:
    """The README's `--output-file FILE.json` for every bench; --check-only wrote nothing."""
    import json

    out = tmp_path / "kernels.json"
    assert bench_kernels.main(["--check-only", flag, str(out)]) == 0
    checks = json.loads(out.read_text())["checks"]
    assert {"rmsnorm", "decode_attention", "extend_attention", "token_bitmask", "fused_moe", "dequant_gemm_w4a16",
            "dequant_gemm_w8a16"} <= {c["kernel"] for c in checks}
    assert all(c["ok"] and c["max_abs_err"] >= 0 for c in checks) and {"float32", "float16"} <= {c["dtype"] for c in checks}
