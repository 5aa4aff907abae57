"""From the repository root the working directory is on sys.path and tandem's top-level kernels/
folder would shadow Hugging Face's `kernels` package, which transformers imports: a tool run there
must work (kernels/__init__.py stands aside under that bare name), and the sdist built there must
carry the gRPC proto a wheel is built from."""
from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def run_in_root(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=240)


def test_make_tiny_model_runs_from_the_root(tmp_path):
    done = run_in_root("-m", "tandem.launch.make_tiny_model", str(tmp_path / "tiny"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "tiny" / "config.json").exists()


def test_the_bare_name_kernels_is_never_tandems():
    probe = "import kernels, sys; print(kernels.__name__, 'tandem' in (kernels.__doc__ or '').split()[:1])"
    done = run_in_root("-c", f"try:\n    {probe}\nexcept ModuleNotFoundError:\n    print('absent')")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() in ("kernels False", "absent")


def test_the_sdist_built_in_the_root_carries_the_proto(tmp_path):
    done = run_in_root("setup.py", "-q", "sdist", "-d", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    (sdist,) = tmp_path.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        assert any(name.endswith("runtime/server/proto/sglang.proto") for name in tar.getnames())
