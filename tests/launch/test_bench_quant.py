"""`tandem bench one-batch --quantization ...` (launch/bench_quant.py): every weight format of the
GGUF model in one call, one table, and the batch-1 bandwidth bound."""
from __future__ import annotations

import json

import pytest

from tandem.launch import bench_llamacpp, bench_one_batch, bench_quant
from tandem.runtime.model_files import default_model_path


def test_variants_resolve_to_a_file_and_a_quantization(tiny_model_dir):
    shipped = default_model_path()
    assert bench_quant.resolve(None, "none") == (None, "none")
    assert bench_quant.resolve(None, "gguf") == (None, "gguf")
    path, quantization = bench_quant.resolve(None, "q8_0")
    assert quantization == "gguf" and path != shipped and path.endswith("-q8_0.gguf")
    with pytest.raises(ValueError, match="not one"):
        bench_quant.resolve(tiny_model_dir("llama"), "q8_0")
    with pytest.raises(ValueError, match="one of"):
        bench_quant.resolve(None, "fp8")


@pytest.mark.timeout(900)
def test_one_call_runs_each_format_and_prints_the_bound(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench_llamacpp, "binary", lambda: None)  # a machine without llama.cpp built: no peer rows
    out = tmp_path / "rows.jsonl"
    assert bench_one_batch.main(["--quantization", "gguf", "q8_0", "--batch-size", "1", "2", "--input-len", "8",
                                 "--output-len", "3", "--dtype", "float32", "--output-file", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["variant"], r["batch_size"]) for r in rows] == [("gguf", 1), ("gguf", 2), ("q8_0", 1), ("q8_0", 2)]
    assert [r["weights"] for r in rows] == ["gguf:q4_1+q8_0"] * 2 + ["gguf:q8_0"] * 2
    first = rows[0]
    assert 90e6 < first["decode_bytes_per_token"] <= first["weight_bytes"]  # every linear and the head, once
    assert first["bandwidth_bound_tok_s"] > 0 and first["stream_gb_s_1gib"] > 0
    text = capsys.readouterr().out
    assert "B/token MB" in text and "gguf gguf:q4_1+q8_0" in text and "q8_0 gguf:q8_0" in text


# what llama-batched-bench --output-format jsonl prints per batch (its log lines around it)
_FAKE_BENCH = """#!/bin/sh
echo "main: n_kv_max = 4096" >&2
for pl in $(echo "$ARGS_NPL" | tr , ' '); do
  echo "{\\"n_kv_max\\": 4096, \\"n_batch\\": 2048, \\"n_ubatch\\": 512, \\"flash_attn\\": 0, \\"is_pp_shared\\": 0, \\"n_gpu_layers\\": 0, \\"n_threads\\": 2, \\"n_threads_batch\\": 2, \\"pp\\": 8, \\"tg\\": 3, \\"pl\\": $pl, \\"n_kv\\": 11, \\"t_pp\\": 0.1, \\"speed_pp\\": $((pl * 80)).0, \\"t_tg\\": 0.1, \\"speed_tg\\": $((pl * 30)).5, \\"t\\": 0.2, \\"speed\\": 1.0}"
done
echo "$@" > "$(dirname "$0")/args"
"""


def test_llamacpp_peer_rows_parse_its_jsonl_and_give_ratios(tmp_path, monkeypatch):
    exe = tmp_path / "llama-batched-bench"
    exe.write_text(_FAKE_BENCH.replace("$ARGS_NPL", "${14}"))  # -npl's value: the 14th argument
    exe.chmod(0o755)
    monkeypatch.setattr(bench_llamacpp, "install_dir", lambda: tmp_path)
    ours = [{"variant": "gguf", "weights": "gguf:q4_1", "model_path": str(exe), "batch_size": b,
             "decode_throughput_tok_s": 60.0 * b, "prefill_throughput_tok_s": 40.0 * b, "weight_bytes": 1} for b in (1, 4)]
    peers = bench_quant.llamacpp_rows(ours, 8, 3)
    assert [(p["variant"], p["batch_size"], p["decode_throughput_tok_s"], p["prefill_throughput_tok_s"]) for p in peers] \
        == [("llama.cpp", 1, 30.5, 80.0), ("llama.cpp", 4, 120.5, 320.0)]
    args = (tmp_path / "args").read_text().split()
    assert args[args.index("-npp") + 1] == "8" and args[args.index("-ntg") + 1] == "3"
    assert args[args.index("-npl") + 1] == "1,4" and "--output-format" in args
    lines = bench_quant.peer_ratio_lines(ours + peers)
    assert lines == [f"tandem gguf / llama.cpp on {exe.name}, batch 1: decode 1.97x, prefill 0.50x",
                     f"tandem gguf / llama.cpp on {exe.name}, batch 4: decode 1.99x, prefill 0.50x"]
    assert any(line.startswith("llama.cpp gguf:q4_1") for line in bench_quant.summary_rows(ours + peers))


def test_bench_offline_runs_llamacpp_on_each_file_at_the_workloads_mean_lengths(tmp_path, monkeypatch):
    from types import SimpleNamespace

    exe = tmp_path / "llama-batched-bench"
    exe.write_text(_FAKE_BENCH.replace("$ARGS_NPL", "${14}"))
    exe.chmod(0o755)
    monkeypatch.setattr(bench_llamacpp, "install_dir", lambda: tmp_path)
    held = {"gguf": "gguf:q4_1", "none": "none"}

    def engine_run(path, quantization):  # a timed engine run's result, as bench_offline's gives it
        return SimpleNamespace(seconds=1.0, after={"weight_quantization": held[quantization], "weight_bytes": 1})
    rows = bench_quant.offline(["gguf", "none"], str(exe), [[1] * 6, [1] * 10, [1] * 7, [1] * 9], [2, 4, 3, 3],
                               engine_run)
    peers = [r for r in rows if r["variant"] == "llama.cpp"]
    assert [(p["variant"], p["weights"], p["batch_size"]) for p in peers] == [("llama.cpp", "gguf:q4_1", 4)]
    assert peers[0]["output_tok_s"] == 4 * 3 / 0.2  # the fake's pl x tg over its whole run's t
    args = (tmp_path / "args").read_text().split()
    assert (args[args.index("-npl") + 1], args[args.index("-npp") + 1], args[args.index("-ntg") + 1]) == ("4", "8", "3")


def test_llamacpp_build_names_each_extension_and_keeps_amx_off():
    flags = bench_llamacpp.cmake_flags({"avx2", "avx512f", "avx512_vnni", "amx_int8", "amx_bf16"})
    assert "-DGGML_NATIVE=OFF" in flags and "-DGGML_AVX512=ON" in flags and "-DGGML_AVX512_VNNI=ON" in flags
    assert "-DGGML_AVX512_BF16=OFF" in flags and "-DGGML_AMX_INT8=OFF" in flags and "-DGGML_AMX_BF16=OFF" in flags


@pytest.mark.timeout(600)
def test_the_shipped_file_held_quantized_is_resident_in_at_most_a_quarter_more_than_its_size():
    """Issue 49's memory target, measured as the RSS a model process adds (less its KV pool)."""
    import os

    size = os.path.getsize(default_model_path())
    resident = bench_quant.resident_weight_bytes(None, "gguf", "float32")
    assert 0.8 * size < resident <= 1.25 * size, (resident, size)
