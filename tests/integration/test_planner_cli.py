"""`pdserve profile` measures the real engine here; `pdserve plan` turns it into pool sizes."""

import json
import math
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import yaml

from pdserve.engine.profile import Profile, fit_cached_attention, fit_colocated, fit_decode, fit_prefill


def pdserve(*args, cwd=None):
    env = dict(os.environ)
    return subprocess.run([sys.executable, "-m", "pdserve.cluster.cli", *args], capture_output=True, text=True,
                          timeout=600, env=env, cwd=cwd)


def test_profile_then_plan(tiny_llama_dir, tmp_path):
    profile_path = tmp_path / "profile.json"
    out = pdserve("profile", "--model", str(tiny_llama_dir), "--out", str(profile_path), "--repeats", "2",
                  "--max-num-batched-tokens", "512", "--max-model-len", "1024")
    assert out.returncode == 0, out.stderr[-2000:]
    profile = Profile.load(profile_path)
    assert profile.max_num_batched_tokens == 512
    # measured, not assumed (how fast is for benchmarks/): every figure a positive, finite time
    assert 0 < profile.kv_bandwidth_bytes_per_s < math.inf
    prefill, decode = profile.samples["prefill"], profile.samples["decode"]
    assert sorted(t for t, _, _ in prefill) == sorted([32, 32, 128, 128, 256, 256, 512, 512])  # 1 and 4 pieces
    assert len(decode) >= 4
    assert all(0 < s[2] < math.inf for s in prefill + decode)
    # the latency model is the fit of those measurements
    assert profile.prefill_coeffs[:3] == pytest.approx(fit_prefill([tuple(s) for s in prefill]))
    assert profile.decode_coeffs == pytest.approx(fit_decode([tuple(s) for s in decode]))
    # mixed steps: a 128-token prompt beside 4, 16 and 64 running decodes of 128-token contexts
    # (larger prompts would not fit this 512-token budget beside them)
    mixed = profile.samples["mixed"]
    assert [(t, q, b) for t, q, b, _, _ in mixed] == [(128, 128 * 128, b) for b in (4, 16, 64)]
    assert all(b * 129 <= c <= b * 140 and 0 < s < math.inf for _, _, b, c, s in mixed)
    assert profile.colocated_coeffs[:7] == pytest.approx(
        fit_colocated([tuple(s) for s in prefill], [tuple(s) for s in decode], [tuple(s) for s in mixed]))
    # steps over a cached 512-token prefix (1536 would not fit this 1024-token context): 64 and
    # 256 new tokens alone and beside 4 and 16 decodes; every new token attends the whole prefix
    cached = profile.samples["cached"]
    assert [(t, b, k) for t, _, b, _, k, _ in cached] == [(64, 0, 64 * 512), (256, 0, 256 * 512),
                                                          (64, 4, 64 * 512), (256, 16, 256 * 512)]
    assert all(q == t * (512 + t) and 0 < s < math.inf for t, q, _, _, _, s in cached)
    # ... and the K terms are what the fresh-prompt model leaves over of them
    fresh = replace(profile, prefill_coeffs=profile.prefill_coeffs[:3], colocated_coeffs=profile.colocated_coeffs[:7])
    assert profile.prefill_coeffs[3] == pytest.approx(fit_cached_attention(
        [(k, s, fresh.prefill_step_s(t, q)) for t, q, b, _, k, s in cached if not b]))
    assert profile.colocated_coeffs[7] == pytest.approx(fit_cached_attention(
        [(k, s, fresh.colocated_step_s(t, q, b, c)) for t, q, b, c, k, s in cached if b]))

    # calibrated to a step log in which decode steps took 1.5x the profile's word (no prefill
    # engine logged: one factor, no co-tenancy term)
    profile = replace(profile, decode_coeffs=(0.01, 0.002, 1e-5))
    profile_path.write_text(profile.to_json())
    logs = tmp_path / "steps"
    logs.mkdir()
    (logs / "decode-123.jsonl").write_text("".join(
        json.dumps({"t": i, "s": 1.5 * profile.decode_step_s(b, b * 100), "T": 0, "Q": 0, "B": b, "C": b * 100})
        + "\n" for i, b in enumerate((1, 2, 4, 8, 16, 32))))
    out = pdserve("calibrate", "--profile", str(profile_path), "--step-log", str(logs), "--out",
                  str(tmp_path / "calibrated.json"))
    assert out.returncode == 0, out.stderr[-2000:]
    calibrated = Profile.load(tmp_path / "calibrated.json")
    assert calibrated.decode_coeffs == pytest.approx(tuple(1.5 * c for c in profile.decode_coeffs))
    assert "'decode': 1.5" in out.stdout and "decode steps:" not in out.stdout  # no co-tenancy told
    assert calibrated.prefill_coeffs == profile.prefill_coeffs
    assert calibrated.first_token_overhead_s == 0  # none given, none in the profile
    out = pdserve("calibrate", "--profile", str(profile_path), "--step-log", str(tmp_path / "none"), "--out",
                  str(tmp_path / "x.json"))
    assert out.returncode == 2 and "no step records" in out.stderr
    out = pdserve("calibrate", "--profile", str(profile_path), "--step-log", str(logs), "--out",
                  str(tmp_path / "overhead.json"), "--first-token-overhead", "0.15")
    assert out.returncode == 0, out.stderr[-2000:]
    assert Profile.load(tmp_path / "overhead.json").first_token_overhead_s == 0.15
    out = pdserve("calibrate", "--profile", str(profile_path), "--step-log", str(logs), "--out",
                  str(tmp_path / "x.json"), "--first-token-overhead", "-1")
    assert out.returncode == 2 and "first_token_overhead_s must be a finite number >= 0" in out.stderr

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
