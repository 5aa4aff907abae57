"""Builds the gRPC message classes from runtime/server/proto/*.proto (grpcio-tools' protoc) as
part of every build, editable installs included; the generated *_pb2.py files are not committed."""
from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PROTO_DIR = Path("runtime/server/proto")


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        super().run()
        # editable installs import the sources in place; a wheel gets the files in its build dir
        out = PROTO_DIR if self.editable_mode else Path(self.build_lib, "tandem/runtime/server/proto")
        out.mkdir(parents=True, exist_ok=True)
        from grpc_tools import protoc

        for proto in sorted(PROTO_DIR.glob("*.proto")):
            if protoc.main(["protoc", f"-I{PROTO_DIR}", f"--python_out={out}", f"--pyi_out={out}", str(proto)]):
                raise RuntimeError(f"protoc failed on {proto}")


setup(cmdclass={"build_py": BuildPyWithProtos})
