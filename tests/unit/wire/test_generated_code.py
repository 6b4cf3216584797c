"""The committed *_pb2.py must be what protoc generates from the committed .proto."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_generated_code_is_not_stale(tmp_path):
    pytest.importorskip("grpc_tools")
    out = tmp_path / "gen"
    out.mkdir()
    cmd = [
        sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}",
        f"--python_out={out}", f"--pyi_out={out}", str(ROOT / "proto/flodl/v1/flodl.proto"),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True)
    for name in ("flodl_pb2.py", "flodl_pb2.pyi"):
        fresh = (out / "flodl/v1" / name).read_text()
        committed = (ROOT / "flodl/wire" / name).read_text()
        assert fresh == committed, f"flodl/wire/{name} is stale: run `make proto` and commit"
