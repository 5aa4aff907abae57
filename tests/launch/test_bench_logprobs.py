"""`tandem bench logprobs`: the offline part writes every result key; the end-to-end part times
real scoring requests against a server, and the three formats carry the same numbers."""
from __future__ import annotations

import base64
import contextlib
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import orjson
import pytest

from server_utils import ServerHandle, start_server
from tandem.launch import bench_logprobs
from tandem.launch.bench_logprobs import E2E_FORMATS, FORMATS, BenchError, check_e2e_agree, e2e_body, main, run_local


def test_main_writes_all_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    assert main(["--positions", "512", "--k", "2", "--repeats", "2", "--output-file", str(out)]) == 0
    result = orjson.loads(out.read_bytes())
    for key in ("nested_ms", "flat_ms", "b64_ms", "nested_bytes", "flat_bytes", "b64_bytes",
                "flat_speedup_over_nested", "b64_speedup_over_nested",
                "flat_size_ratio", "b64_size_ratio"):
        assert result[key] > 0, key
    assert result["positions"] == 512 and result["k"] == 2
    # Sizes are deterministic (unlike times): flat+b64 is the smallest, nested the largest.
    assert result["b64_bytes"] < result["flat_bytes"] < result["nested_bytes"]
    table = capsys.readouterr().out
    assert all(fmt in table for fmt in FORMATS)


def test_run_local_returns_dict_without_printing(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_local(positions=64, k=3, repeats=1)
    assert result["k"] == 3 and "flat_np_speedup_over_nested" in result
    assert capsys.readouterr().out == ""


# ---- end to end ------------------------------------------------------------------------------

E2E_KEYS = ("e2e_nested_ms", "e2e_flat_ms", "e2e_b64_ms", "e2e_nested_bytes", "e2e_flat_bytes",
            "e2e_b64_bytes", "e2e_flat_speedup_over_nested", "e2e_b64_speedup_over_nested")
PROMPT_LEN = 512  # the tiny model's context is 2048


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    log = tmp_path_factory.mktemp("bench_logprobs") / "server.log"
    handle = start_server(["--model-path", tiny_model_dir("llama"), "--max-total-tokens", "3000"], str(log))
    try:
        yield handle
    finally:
        handle.stop()


@pytest.mark.timeout(300)
def test_e2e_against_server_writes_all_keys(tiny_server: ServerHandle, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    argv = ["--positions", "256", "--repeats", "1", "--base-url", tiny_server.url,
            "--e2e-prompt-len", str(PROMPT_LEN), "--e2e-repeats", "1", "--output-file", str(out)]
    assert main(argv) == 0
    result = orjson.loads(out.read_bytes())
    for key in E2E_KEYS:
        assert result[key] > 0, key
    assert result["nested_ms"] > 0 and result["e2e_prompt_len"] == PROMPT_LEN
    # every format carries the same nested input_token_logprobs; only the top rows shrink
    assert result["e2e_b64_bytes"] < result["e2e_flat_bytes"] < result["e2e_nested_bytes"]
    assert "logprobs e2e" in capsys.readouterr().out


def _own_decode(meta: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, int]:
    """Decoded here, independently of the bench's helpers."""
    if "input_top_logprobs" in meta:
        rows = meta["input_top_logprobs"]
        prefix = next(n for n, row in enumerate(rows) if row is not None)
        vals = np.array([[t[0] for t in r] for r in rows[prefix:]], np.float32)
        return vals, np.array([[t[1] for t in r] for r in rows[prefix:]], np.int32), prefix
    shape = tuple(meta["input_top_logprobs_shape"])
    if "input_top_logprobs_val_flat_b64" in meta:
        v = np.frombuffer(base64.b64decode(meta["input_top_logprobs_val_flat_b64"]),
                          meta["input_top_logprobs_val_flat_b64_dtype"])
        i = np.frombuffer(base64.b64decode(meta["input_top_logprobs_idx_flat_b64"]),
                          meta["input_top_logprobs_idx_flat_b64_dtype"])
    else:
        v, i = np.array(meta["input_top_logprobs_val_flat"]), np.array(meta["input_top_logprobs_idx_flat"])
    return v.reshape(shape), i.reshape(shape), meta["input_top_logprobs_null_prefix"]


@pytest.mark.timeout(300)
def test_e2e_formats_agree(tiny_server: ServerHandle) -> None:
    vocab = tiny_server.get("/model_info").json()["vocab_size"]
    ids = np.random.default_rng(1).integers(0, vocab, PROMPT_LEN).tolist()
    decoded = {}
    for fmt in E2E_FORMATS:
        resp = tiny_server.post("/generate", data=e2e_body(ids, 2, fmt),
                                headers={"Content-Type": "application/json"})
        assert resp.status_code == 200, resp.text
        assert resp.json()["output_ids"] == []
        decoded[fmt] = _own_decode(resp.json()["meta_info"])
    ref_v, ref_i, ref_p = decoded["nested"]
    assert ref_p == 1 and ref_v.shape == (PROMPT_LEN - 1, 2)
    for fmt in ("flat", "b64"):
        v, i, p = decoded[fmt]
        assert p == ref_p and np.array_equal(i, ref_i), fmt
        np.testing.assert_allclose(v, ref_v, rtol=1e-6, atol=1e-6)
    check_e2e_agree(decoded, PROMPT_LEN)  # the bench's own guard accepts what agrees


def test_check_e2e_agree_rejects_mismatch() -> None:
    v = np.array([[-0.5, -1.0], [-0.2, -3.0]], np.float32)
    i = np.array([[3, 4], [5, 6]], np.int32)
    good = {"nested": (v, i, 1), "flat": (v.copy(), i.copy(), 1), "b64": (v.copy(), i.copy(), 1)}
    check_e2e_agree(good, 3)
    with pytest.raises(BenchError, match="values differ"):
        check_e2e_agree({**good, "b64": (v + 0.1, i, 1)}, 3)
    with pytest.raises(BenchError, match="ids"):
        check_e2e_agree({**good, "flat": (v, i[:, ::-1], 1)}, 3)
    with pytest.raises(BenchError, match="rows for a 4-token prompt"):
        check_e2e_agree(good, 4)


def test_launch_passes_server_args_and_stops(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """--launch wiring without a real server: the launch context gets the quoted server args,
    and run_e2e runs inside it."""
    events: list[str] = []

    @contextlib.contextmanager
    def fake_launch(args: Any) -> Iterator[str]:
        events.append(f"start {args.server_args} {args.server_module}")
        yield "http://fake"
        events.append("stop")

    def fake_run(base_url: str, *a: Any, **kw: Any) -> dict[str, Any]:
        events.append(f"run {base_url}")
        return {key: 1.0 for key in E2E_KEYS}

    monkeypatch.setattr(bench_logprobs, "launched_server", fake_launch)
    monkeypatch.setattr(bench_logprobs, "run_e2e", fake_run)
    out = tmp_path / "bench.json"
    argv = ["--positions", "8", "--repeats", "1", "--launch", "--server-args", "--max-total-tokens 20000",
            "--output-file", str(out)]
    assert main(argv) == 0
    assert events == ["start --max-total-tokens 20000 tandem.launch.server", "run http://fake", "stop"]
    assert orjson.loads(out.read_bytes())["e2e_b64_ms"] == 1.0
