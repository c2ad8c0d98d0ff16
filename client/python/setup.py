"""Builds the tessel package; its gRPC/protobuf stubs are generated here from
../../proto (never committed)."""
import pathlib

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = pathlib.Path(__file__).resolve().parent
PROTO_ROOT = HERE.parent.parent / "proto"


def generate_stubs():
    protos = sorted(PROTO_ROOT.glob("tessel/v1/*.proto"))
    if not protos:
        if list((HERE / "tessel" / "v1").glob("*_pb2.py")):
            return  # building from an sdist that already carries them
        raise RuntimeError(f"no .proto files under {PROTO_ROOT}")
    import grpc_tools
    from grpc_tools import protoc
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={HERE}",
            f"--grpc_python_out={HERE}"] + [str(p.relative_to(PROTO_ROOT)) for p in protos]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on " + " ".join(map(str, protos)))


class BuildPyWithStubs(build_py):
    def run(self):
        generate_stubs()
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs})
