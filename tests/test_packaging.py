"""The package as a user gets it: the sdist built from this tree, a wheel built from that sdist,
the wheel installed into a fresh venv, and `tandem serve` from the venv answering /generate and
gRPC on the tiny model. The venv sees this interpreter's site-packages for the dependencies
(torch and the rest) through a plain path entry, so their .pth files, among them the editable
install's finder, never run there: tandem itself can only come from the wheel.

One build and one venv per session (module fixture). The first start compiles the CPU ops from
the wheel's csrc/ (about two minutes on two cores), into a folder of the session's own so the
checkout's build in ~/.cache/torch_extensions is not rebuilt under other paths.
"""
from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from server_utils import ServerHandle, _wait_healthy
from tandem.runtime.launcher import free_port

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = "tandem/runtime/server/proto"


def _run(cmd: list[str], cwd: Path, **kw) -> str:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, **kw)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_every_package_folder_is_in_the_package_list():
    """pyproject.toml lists the packages by hand (package-dir maps the four folders under tandem.*):
    a folder with an __init__.py that is not listed is left out of every wheel, and the installed
    server fails on its import while the checkout, importing in place, works."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join([name, *init.parent.relative_to(ROOT / folder).parts])
             for name, folder in cfg["package-dir"].items() for init in (ROOT / folder).rglob("__init__.py")}
    missing = sorted(found - set(cfg["packages"]))
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {missing}"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> SimpleNamespace:
    out = tmp_path_factory.mktemp("packaging")
    # the sdist through the build backend, as `python -m build --sdist` calls it (no isolation: the
    # build requirements are this environment's)
    name = _run([sys.executable, "-c", "import setuptools.build_meta as b, sys; print(b.build_sdist(sys.argv[1]))",
                 str(out / "sdist")], cwd=ROOT).strip().splitlines()[-1]
    sdist = out / "sdist" / name
    # the wheel from the sdist (pip unpacks it and builds there: protoc runs on the sdist's proto)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir",
          "--wheel-dir", str(out / "wheel"), str(sdist)], cwd=out)
    (wheel,) = (out / "wheel").glob("tandem_serve-*.whl")
    venv = out / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=out)
    python = venv / "bin" / "python"
    venv_site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=out).strip())
    (venv_site / "_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    # --ignore-installed: the dependencies' path also shows the checkout's editable tandem-serve
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--ignore-installed",
          "--no-index", "--no-cache-dir", str(wheel)], cwd=out)
    return SimpleNamespace(root=out, sdist=sdist, wheel=wheel, venv=venv, python=python, site=venv_site)


def test_the_sdist_and_the_wheel_carry_the_data_files(installed):
    with tarfile.open(installed.sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    for path in ("runtime/server/proto/sglang.proto", "configs/default.toml", "kernels/csrc/decode_layers_cpu.cpp",
                 "setup.py", "pyproject.toml"):
        assert path in names, path
    with zipfile.ZipFile(installed.wheel) as whl:
        names = set(whl.namelist())
        entry_points = next(whl.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    for path in (f"{PROTO_DIR}/sglang.proto", f"{PROTO_DIR}/sglang_pb2.py", "tandem/configs/default.toml",
                 "tandem/kernels/csrc/decode_layers_cpu.cpp", "tandem/launch/server.py"):
        assert path in names, path
    assert not any(n.startswith(("runtime/", "kernels/", "tests/")) for n in names)  # all under tandem/
    assert "tandem = tandem.launch.cli:main" in entry_points


def test_tandem_imports_from_the_venv_not_the_checkout(installed, tmp_path):
    code = ("import json, tandem, tandem.runtime.server.proto.sglang_pb2 as pb, tandem.launch.server, "
            "tandem.kernels, importlib.metadata as m; print(json.dumps({'path': list(tandem.__path__), "
            "'files': [pb.__file__, tandem.launch.server.__file__, tandem.kernels.__file__], "
            "'dist': str(m.distribution('tandem-serve')._path)}))")
    found = json.loads(_run([str(installed.python), "-c", code], cwd=tmp_path))
    for path in found["path"] + found["files"] + [found["dist"]]:
        assert path.startswith(str(installed.site)) and not path.startswith(str(ROOT)), found


@pytest.mark.timeout(900)
def test_the_installed_server_answers_generate_and_grpc(installed, tiny_model_dir, tmp_path):
    import grpc

    from tandem.runtime.server.proto import sglang_pb2 as pb

    port, grpc_port = free_port(), free_port()
    log = tmp_path / "server.log"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(installed.root / "torch_extensions")}
    cmd = [str(installed.venv / "bin" / "tandem"), "serve", "--model-path", tiny_model_dir("llama"), "--port", str(port),
           "--grpc-port", str(grpc_port), "--dtype", "float32", "--max-total-tokens", "3000"]
    with open(log, "w") as f:  # the console script of the wheel, away from the checkout
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=tmp_path, start_new_session=True)
    server = ServerHandle(proc, f"http://127.0.0.1:{port}", str(log))
    try:
        _wait_healthy(server)
        body = {"input_ids": [5, 6, 7], "sampling_params": {"temperature": 0, "max_new_tokens": 4}}
        out = server.generate(body)
        assert len(out["output_ids"]) == 4 and out["meta_info"]["finish_reason"]["type"] == "length", out
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            rpc = channel.unary_stream("/sglang.runtime.v1.SglangService/Generate",
                                       request_serializer=pb.GenerateRequest.SerializeToString,
                                       response_deserializer=pb.GenerateResponse.FromString)
            (reply,) = rpc(pb.GenerateRequest(input_ids=[5, 6, 7], sampling_params=pb.SamplingParams(
                temperature=0, max_new_tokens=4)), timeout=120)  # not streamed: one answer
        assert list(reply.output_ids) == out["output_ids"] and reply.finished
        assert server.get("/ready").status_code == 200
    finally:
        status = server.stop()
    assert status == 0, server.log()[-3000:]
    assert str(ROOT) not in server.log()  # no traceback through the checkout's files either
