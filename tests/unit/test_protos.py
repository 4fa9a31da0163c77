"""The committed generated modules match pdserve.proto, and importing them runs nothing;
messages convert to plain values."""

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
            "import protos, protos.convert, rpc.channel")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    after = {p: p.stat().st_mtime_ns for p in (ROOT / "protos").iterdir()}
    assert {p for p in after if p.name != "__pycache__"} == {p for p in before if p.name != "__pycache__"}
    assert all(after[p] == before[p] for p in before if p.suffix in (".py", ".pyi", ".proto"))


def test_message_dict_turns_worker_stats_into_plain_values():
    """What a worker actor hands the controller (Ray): nested histograms and repeated
    transfer messages included, which a flat field copy could not convert."""
    import json

    from pdserve.protos import pdserve_pb2 as pb
    from pdserve.protos.convert import message_dict
    from pdserve.worker_base.telemetry import TransferCounters

    counters = TransferCounters()
    counters.succeeded("torch", "send", 100, 0.5)
    counters.failed("grpc", "receive", "timeout")
    stats = pb.WorkerStats(worker_id="w", num_running=2, prefill_decisions={"remote/x": 3},
                           transfers=counters.to_proto(), kv_bytes_sent=2**40)
    stats.step_seconds.bounds[:] = [0.1, 1.0]
    stats.step_seconds.counts[:] = [1, 2, 0]
    out = message_dict(stats)
    assert out["num_running"] == 2 and out["kv_bytes_sent"] == 2**40 and out["prefill_decisions"] == {"remote/x": 3}
    assert out["step_seconds"] == {"bounds": [0.1, 1.0], "counts": [1, 2, 0], "sum": 0.0}
    assert [(t["transport"], t["direction"], t["bytes"], t["failures"]) for t in out["transfers"]] == [
        ("grpc", "receive", 0, {"timeout": 1}), ("torch", "send", 100, {})]
    json.dumps(out)  # plain values all the way down
