"""The checked-in generated code must be what `make proto` would generate now."""

from __future__ import annotations

import shutil
import subprocess
import sys

from tests.source_roots import ROOT

PROTO = ROOT / "proto" / "fedbroker" / "proto"
GENERATED = ["fedbroker_pb2.py", "fedbroker_pb2.pyi", "fedbroker_pb2_grpc.py"]


def test_checked_in_protobuf_code_is_not_stale(tmp_path):
    (tmp_path / "fedbroker" / "proto").mkdir(parents=True)
    shutil.copy(PROTO / "fedbroker.proto", tmp_path / "fedbroker" / "proto")
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.", "--pyi_out=.", "--grpc_python_out=.",
         "fedbroker/proto/fedbroker.proto"], cwd=tmp_path, check=True,
    )
    for name in GENERATED:
        fresh = (tmp_path / "fedbroker" / "proto" / name).read_text()
        assert (PROTO / name).read_text() == fresh, f"{PROTO.relative_to(ROOT)}/{name} is stale: run `make proto`"
