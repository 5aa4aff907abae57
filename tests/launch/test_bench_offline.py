"""`tandem bench offline` on the tiny model: one run, every JSON key, ratios consistent with the tok/s."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.launch.bench_offline import Workload, batches, main, make_workload
from tandem.launch.bench_transformers import left_pad

TOK_S_KEYS = ("tandem_overlap_tok_s", "tandem_no_overlap_tok_s", "bare_tok_s", "transformers_tok_s")


def test_workload_is_seeded_and_in_range() -> None:
    a, b = make_workload(10, 8, 24, 1000, seed=3), make_workload(10, 8, 24, 1000, seed=3)
    assert a == b and a != make_workload(10, 8, 24, 1000, seed=4)
    assert all(8 <= len(p) <= 24 for p in a.prompts) and all(8 <= n <= 24 for n in a.output_lens)
    assert all(17 <= t < 1000 for p in a.prompts for t in p)
    assert [len(ps) for ps, _ in batches(a, 4)] == [4, 4, 2]


def test_left_pad_masks_the_padding() -> None:
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


@pytest.mark.timeout(300)
def test_main_writes_every_key(tiny_model_dir, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "offline.json"
    argv = ["--model-path", tiny_model_dir("llama"), "--num-seqs", "8", "--min-len", "8", "--max-len", "24",
            "--hf-batch-size", "4", "--output-file", str(out)]
    assert main(argv) == 0
    r = json.loads(out.read_text())
    for key in TOK_S_KEYS + ("tandem_over_transformers", "tandem_over_bare", "overlap_speedup"):
        assert r[key] > 0, key
    # the ratios are the tok/s values divided (rounding aside)
    assert r["tandem_over_transformers"] == pytest.approx(r["tandem_overlap_tok_s"] / r["transformers_tok_s"], rel=1e-2)
    assert r["tandem_over_bare"] == pytest.approx(r["tandem_overlap_tok_s"] / r["bare_tok_s"], rel=1e-2)
    assert r["overlap_speedup"] == pytest.approx(r["tandem_overlap_tok_s"] / r["tandem_no_overlap_tok_s"], rel=1e-2)
    for key in ("idle_fraction_overlap", "idle_fraction_no_overlap"):
        assert 0.0 <= r[key] <= 1.0, key
    assert r["dtype"] == "float32" and r["num_seqs"] == 8
    assert r["cpu_cores"] >= 1 and r["cpu_model"]
    wl = make_workload(8, 8, 24, 49152, seed=0)
    assert r["total_output_tokens"] == wl.output_tokens
    # every system did the same useful work; static batching pads, the engine does not
    for key in ("overlap", "no_overlap", "bare", "transformers"):
        assert r[f"{key}_seconds"] > 0
        assert 0 < r[f"{key}_useful_fraction"] <= 1
    assert r["overlap_useful_fraction"] == 1.0
    assert r["tandem_overlap_tok_s"] == pytest.approx(wl.output_tokens / r["overlap_seconds"], rel=1e-2)
    table = capsys.readouterr().out
    assert "tandem (overlap on)" in table and "transformers generate" in table and "tandem / bare" in table


def test_skip_transformers_leaves_its_keys_null(monkeypatch, tmp_path: Path, capsys) -> None:
    """The report side alone: the systems are stubbed, so nothing starts."""
    from tandem.launch import bench_offline as bo

    def result(name: str, seconds: float, wl: Workload, idle: float | None = None) -> bo.SystemResult:
        return bo.SystemResult(name, wl.output_tokens, seconds, wl.output_tokens, idle)

    monkeypatch.setattr(bo, "model_vocab", lambda path: 1000)
    monkeypatch.setattr(bo, "run_engine", lambda args, wl, overlap: result("e", 1.0 if overlap else 2.0, wl, 0.25))
    monkeypatch.setattr(bo, "run_bare", lambda args, wl: result("bare", 0.5, wl))
    monkeypatch.setattr(bo, "run_transformers", lambda args, wl: pytest.fail("transformers ran"))
    out = tmp_path / "r.json"
    assert bo.main(["--skip-transformers", "--num-seqs", "4", "--output-file", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["transformers_tok_s"] is None and r["tandem_over_transformers"] is None
    assert r["overlap_speedup"] == 2.0 and r["tandem_over_bare"] == 0.5
    assert r["idle_fraction_overlap"] == 0.25
    assert "tandem / transformers   -\n" in capsys.readouterr().out


def test_idle_window_uses_the_counter_deltas() -> None:
    from tandem.launch.bench_offline import idle_in_window

    before = {"device_busy_s": 10.0, "device_idle_s": 5.0, "device_idle_fraction": 0.33}
    after = {"device_busy_s": 19.0, "device_idle_s": 6.0, "device_idle_fraction": 0.24}
    assert idle_in_window(before, after) == 0.1
    assert idle_in_window({}, {"device_idle_fraction": 0.2}) == 0.2


@pytest.mark.timeout(300)
def test_json_schema_run_matches_lengths_and_reports_the_ratio(tiny_model_dir, tmp_path: Path, monkeypatch,
                                                               capsys) -> None:
    from tandem.launch import bench_offline as bo

    def stub(name: str, wl: Workload) -> bo.SystemResult:
        return bo.SystemResult(name, wl.output_tokens, 1.0, wl.output_tokens)

    monkeypatch.setattr(bo, "run_engine", lambda args, wl, overlap: stub("e", wl))
    monkeypatch.setattr(bo, "run_bare", lambda args, wl: stub("bare", wl))
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}))
    out = tmp_path / "r.json"
    argv = ["--model-path", tiny_model_dir("llama"), "--num-seqs", "4", "--min-len", "8", "--max-len", "16",
            "--skip-transformers", "--json-schema", str(schema), "--output-file", str(out)]
    assert bo.main(argv) == 0
    r = json.loads(out.read_text())
    assert r["guided_over_unconstrained"] == pytest.approx(r["guided_seconds"] and
                                                           r["guided_baseline_seconds"] / r["guided_seconds"], rel=2e-2)
    assert r["guided_grammar_mask_us_per_row"] > 0
    assert "json_schema / unconstrained (same output lengths)" in capsys.readouterr().out


@pytest.mark.timeout(300)
def test_ctranslate2_peer_and_gemm_bound(tiny_model_dir, tmp_path: Path, monkeypatch, capsys) -> None:
    """CTranslate2 fp32 and int8 as peers at a fixed output length, and the GEMM-only bound row."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "r.json"
    argv = ["--model-path", tiny_model_dir("llama"), "--num-seqs", "6", "--min-len", "8", "--max-len", "20",
            "--output-len", "10", "--peers", "ctranslate2", "--output-file", str(out)]
    assert main(argv) == 0
    r = json.loads(out.read_text())
    assert r["total_output_tokens"] == 60 and r["output_len"] == 10 and r["transformers_tok_s"] is None
    for key in ("ctranslate2_float32_tok_s", "ctranslate2_int8_tok_s", "gemm_bound_tok_s"):
        assert r[key] > 0, key
    assert r["tandem_over_ctranslate2"] == pytest.approx(r["tandem_overlap_tok_s"] / r["ctranslate2_float32_tok_s"],
                                                         rel=1e-2)
    assert r["tandem_over_gemm_bound"] == pytest.approx(r["tandem_overlap_tok_s"] / r["gemm_bound_tok_s"], rel=1e-2)
    assert r["ctranslate2_float32_useful_fraction"] == 1.0  # one output length: no padded work
    table = capsys.readouterr().out
    assert "ctranslate2 float32" in table and "GEMM-only bound" in table and "tandem / ctranslate2" in table


@pytest.mark.timeout(300)
def test_ctranslate2_conversion_gives_tandems_greedy_tokens(tiny_model_dir, tmp_path: Path, monkeypatch) -> None:
    """The converted model is the same model: fp32 greedy ids equal tandem's bare loop."""
    from tandem.launch import bench_ctranslate2
    from tandem.launch.bare_loop import BareLoop
    from tandem.runtime.model.runner import ModelRunner
    from tandem.runtime.server_args import ServerArgs

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    path = tiny_model_dir("llama")
    prompts = [list(range(300, 320)), list(range(700, 709))]
    _, ids = bench_ctranslate2.run(path, prompts, 8, "float32", 2)
    runner = ModelRunner(ServerArgs(model_path=path, max_total_tokens=256, max_running_requests=2, dtype="float32"))
    assert ids == BareLoop(runner).generate(prompts, 8).output_ids


def test_repeats_alternate_and_keep_the_best_of_each(monkeypatch, tmp_path: Path) -> None:
    from tandem.launch import bench_offline as bo

    calls: list[bool] = []
    seconds = iter([3.0, 2.0, 2.5, 1.5])  # off, on, then on, off: the second pair goes on first

    def engine(args, wl, overlap):
        calls.append(overlap)
        return bo.SystemResult("e", wl.output_tokens, next(seconds), wl.output_tokens)

    monkeypatch.setattr(bo, "model_vocab", lambda path: 1000)
    monkeypatch.setattr(bo, "run_engine", engine)
    monkeypatch.setattr(bo, "run_bare", lambda args, wl: bo.SystemResult("bare", wl.output_tokens, 1.0, wl.output_tokens))
    monkeypatch.setattr(bo, "gemm_bound", lambda args, wl: bo.SystemResult(
        "b", wl.output_tokens, 0.1, wl.output_tokens, info={"decode_batch": 4, "decode_tok_s": 40.0}))
    out = tmp_path / "r.json"
    assert bo.main(["--peers", "", "--num-seqs", "4", "--repeats", "2", "--output-file", str(out)]) == 0
    r = json.loads(out.read_text())
    assert calls == [False, True, True, False]
    assert r["no_overlap_seconds"] == 1.5 and r["overlap_seconds"] == 2.0 and r["repeats"] == 2
    # each pair's own ratio (off seconds / on seconds), and their median
    assert r["overlap_speedup_pairs"] == [1.5, 0.6] and r["overlap_speedup_paired_median"] == pytest.approx(1.05)


@pytest.mark.timeout(600)
def test_weight_formats_run_one_engine_each_on_the_same_workload(tmp_path: Path, capsys, monkeypatch) -> None:
    from tandem.launch import bench_llamacpp

    monkeypatch.setattr(bench_llamacpp, "binary", lambda: None)  # no llama.cpp peer rows (test_bench_quant.py's)
    out = tmp_path / "formats.json"
    assert main(["--quantization", "none", "gguf", "--num-seqs", "3", "--min-len", "4", "--max-len", "8",
                    "--dtype", "float32", "--output-file", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(r["variant"], r["weights"]) for r in report["rows"]] == [("none", "none"), ("gguf", "gguf:q4_1+q8_0")]
    assert report["rows"][1]["weight_bytes"] * 3 < report["rows"][0]["weight_bytes"]  # the file's blocks, held
    assert all(r["output_tok_s"] > 0 for r in report["rows"])
    assert "gguf gguf:q4_1+q8_0" in capsys.readouterr().out
