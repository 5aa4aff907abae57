"""The kernel benchmark's check-only path (runs on CPU under the interpreter) and its table helpers."""
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
    assert {"rmsnorm", "decode_attention", "extend_attention"} <= {c["kernel"] for c in checks}
    assert all(c["ok"] and c["max_abs_err"] >= 0 for c in checks) and {"float32", "float16"} <= {c["dtype"] for c in checks}
