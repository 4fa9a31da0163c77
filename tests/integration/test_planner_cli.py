"""`pdserve profile` measures the real engine here; `pdserve plan` turns it into pool sizes."""

import json
import os
import subprocess
import sys

import yaml

from cluster.planner.profile import Profile


def pdserve(*args, cwd=None):
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    return subprocess.run([sys.executable, "-m", "cluster.cli", *args], capture_output=True, text=True,
                          timeout=600, env=env, cwd=cwd)


def test_profile_then_plan(tiny_llama_dir, tmp_path):
    profile_path = tmp_path / "profile.json"
    out = pdserve("profile", "--model", str(tiny_llama_dir), "--out", str(profile_path), "--repeats", "2",
                  "--max-num-batched-tokens", "512", "--max-model-len", "1024")
    assert out.returncode == 0, out.stderr[-2000:]
    profile = Profile.load(profile_path)
    assert profile.max_num_batched_tokens == 512
    assert profile.kv_bandwidth_bytes_per_s > 1e7  # a real measurement over the gloo pair
    assert len(profile.samples["prefill"]) >= 4 and len(profile.samples["decode"]) >= 4
    big = max(profile.samples["prefill"], key=lambda s: s[0])
    small = min(profile.samples["prefill"], key=lambda s: s[0])
    assert big[2] > small[2]  # more prompt tokens take longer

    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"arrival_s": i * 0.1, "prompt_len": 64 + 16 * (i % 8), "max_tokens": 32})
                             + "\n" for i in range(100)))
    plan_path = tmp_path / "plan.yaml"
    out = pdserve("plan", "--profile", str(profile_path), "--ttft-slo", "500ms", "--tpot-slo", "50ms",
                  "--trace", str(trace), "--rate", "20", "--out", str(plan_path))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "disaggregated" in out.stdout and "colocated" in out.stdout
    plan = yaml.safe_load(plan_path.read_text())
    assert plan["prefill"]["replicas"] >= 1 and plan["decode"]["replicas"] >= 1
    assert plan_path.with_suffix(".png").stat().st_size > 1000

    out = pdserve("plan", "--profile", str(profile_path), "--ttft-slo", "1ms", "--tpot-slo", "1ms",
                  "--trace", str(trace), "--out", str(tmp_path / "impossible.yaml"))
    assert out.returncode == 0 and "no configuration meets these SLOs" in out.stdout

    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    out = pdserve("plan", "--profile", str(bad), "--ttft-slo", "1s", "--tpot-slo", "1s", "--trace", str(trace))
    assert out.returncode == 2 and "expected a JSON object" in out.stderr
