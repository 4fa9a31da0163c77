"""The committed generated modules match pdserve.proto, and importing them runs nothing."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_modules_match_the_proto():
    result = subprocess.run([sys.executable, "protos/build.py", "--check"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_importing_protos_never_runs_protoc_or_writes():
    before = {p: p.stat().st_mtime_ns for p in (ROOT / "protos").iterdir()}
    code = ("import grpc_tools.protoc as p\n"
            "def refuse(*args): raise AssertionError('protoc ran on import')\n"
            "p.main = refuse\n"
            "import protos, protos.convert, protos.channel")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    after = {p: p.stat().st_mtime_ns for p in (ROOT / "protos").iterdir()}
    assert {p for p in after if p.name != "__pycache__"} == {p for p in before if p.name != "__pycache__"}
    assert all(after[p] == before[p] for p in before if p.suffix in (".py", ".pyi", ".proto"))
