"""llama.cpp beside tandem in `tandem bench one-batch --quantization ...`: its `llama-batched-bench`
on the same GGUF files, batch sizes and lengths, printed as peer rows when the binary is present.

`python -m tandem.launch.bench_llamacpp build` builds that one binary from llama-cpp-python's sdist
(which vendors llama.cpp) into tandem's cache directory, outside the package: pip downloads the
sdist, cmake builds the target with the CPU's AVX-512 / VNNI / BF16 extensions named one by one.
AMX stays off: with -march=native (which turns on ggml's AMX code) the binary crashes on quantized
files on the AMX machines tandem is measured on, so llama.cpp is timed on its AVX-512 kernels.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST = "llama-cpp-python==0.3.36"
TARGET = "llama-batched-bench"
# ggml's cmake switch for each /proc/cpuinfo flag it needs (AMX deliberately absent)
_ISA_SWITCHES = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "bmi2": "GGML_BMI2", "fma": "GGML_FMA", "f16c": "GGML_F16C",
                 "avx512f": "GGML_AVX512", "avx512vbmi": "GGML_AVX512_VBMI", "avx512_vnni": "GGML_AVX512_VNNI",
                 "avx512_bf16": "GGML_AVX512_BF16"}


def install_dir() -> Path:
    from tandem.runtime.model_files import cache_dir

    return cache_dir() / f"llama.cpp-{SDIST.split('==')[1]}"


def binary() -> Path | None:
    """The built llama-batched-bench, or None (then no peer row is printed)."""
    path = install_dir() / TARGET
    return path if path.is_file() and os.access(path, os.X_OK) else None


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def cmake_flags(cpu_flags: set[str]) -> list[str]:
    """-D switches: no -march=native, each x86 extension the CPU has on, AMX off, nothing but the target's needs."""
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DGGML_OPENMP=ON", "-DLLAMA_CURL=OFF",
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF",
             "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    return flags + [f"-D{switch}={'ON' if flag in cpu_flags else 'OFF'}" for flag, switch in _ISA_SWITCHES.items()]


def build(jobs: int | None = None) -> Path:
    """Downloads the sdist, builds llama-batched-bench and copies it (and its shared libraries) to install_dir()."""
    dest = install_dir()
    with tempfile.TemporaryDirectory(prefix="tandem-llama-") as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST, "-d", tmp],
                       check=True)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        src = next(Path(tmp).glob("llama_cpp_python-*")) / "vendor" / "llama.cpp"
        build_dir = src / "build"
        subprocess.run(["cmake", "-S", str(src), "-B", str(build_dir), *cmake_flags(_cpu_flags())], check=True)
        subprocess.run(["cmake", "--build", str(build_dir), "--target", TARGET, "-j", str(jobs or os.cpu_count() or 1)],
                       check=True)
        dest.mkdir(parents=True, exist_ok=True)
        for path in (build_dir / "bin").iterdir():  # the binary and the libggml / libllama it loads by rpath
            if path.is_file() and (path.name == TARGET or ".so" in path.name):
                shutil.copy2(path, dest / path.name)
    return dest / TARGET


def run(model_path: str, batch_sizes: list[int], input_len: int, output_len: int, threads: int) -> list[dict]:
    """llama-batched-bench on `model_path`: one dict per batch size (prefill and decode tok/s as
    llama.cpp counts them: batch x tokens over the phase's wall time)."""
    exe = binary()
    if exe is None:
        return []
    ctx = max(batch_sizes) * (input_len + output_len) + 64
    cmd = [str(exe), "-m", model_path, "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(input_len),
           "-ntg", str(output_len), "-npl", ",".join(map(str, batch_sizes)), "-t", str(threads), "-tb", str(threads),
           "--output-format", "jsonl"]
    env = os.environ | {"LD_LIBRARY_PATH": f"{exe.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{TARGET} exited {done.returncode}: {done.stderr[-2000:]}")
    return parse(done.stdout + done.stderr)


def parse(output: str) -> list[dict]:
    """The JSON lines of llama-batched-bench --output-format jsonl, as bench one-batch's row fields."""
    rows = []
    for line in output.splitlines():
        line = line.strip()
        if not (line.startswith("{") and '"speed_tg"' in line):
            continue
        r = json.loads(line)
        rows.append({"batch_size": r["pl"], "input_len": r["pp"], "output_len": r["tg"],
                     "prefill_throughput_tok_s": round(r["speed_pp"], 1), "decode_throughput_tok_s": round(r["speed_tg"], 1),
                     "seconds": r["t"], "threads": r["n_threads"]})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.launch.bench_llamacpp", description=__doc__)
    parser.add_argument("command", choices=["build", "where"])
    args = parser.parse_args(argv)
    if args.command == "build":
        print(build())
    else:
        print(binary() or "not built: python -m tandem.launch.bench_llamacpp build")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
