"""The autoscaler on a real local cluster (tiny model): a load step that violates the TPOT
SLO scales the decode pool up; removing the load scales it back down after the cooldown;
no request is lost meanwhile; every decision is visible in status and metrics."""

import os
import subprocess
import sys
import time

from tests.e2e.conftest import start_service, stop_service
from tests.e2e.http import get
from tests.e2e.test_scaling import Traffic, pool_state

# No decode step of any model takes 0.1 ms: the load step violates this TPOT SLO by construction
# (how far above the SLO a machine's TPOT lands is a matter for benchmarks, not this test);
# without load there are no samples and the plan falls back to the pool's minimum.
TPOT_SLO_S = 1e-4


def test_autoscaler_follows_a_load_step(ray_cluster, tiny_llama_dir, tmp_path):
    profile = tmp_path / "profile.json"
    out = subprocess.run([sys.executable, "-m", "cluster.cli", "profile", "--model", str(tiny_llama_dir),
                          "--out", str(profile), "--repeats", "2", "--max-model-len", "1024"],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})
    assert out.returncode == 0, out.stderr[-2000:]

    controller, url = start_service(tiny_llama_dir, **{
        "autoscaler": {"enabled": True, "profile": str(profile), "ttft_slo_s": 30.0, "tpot_slo_s": TPOT_SLO_S,
                       "interval_s": 2.0, "window_s": 6.0, "cooldown_s": 6.0, "min_samples": 3},
        "decode.max_replicas": 3, "prefill.max_replicas": 1, "prefill.min_replicas": 1})
    try:
        with Traffic(url, clients=24, max_tokens=40) as traffic:
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and pool_state(controller)["pools"]["decode"]["target"] < 2:
                time.sleep(1)
            scaled_up = pool_state(controller)["pools"]["decode"]["target"]
            time.sleep(4)
        assert scaled_up >= 2, pool_state(controller)["autoscaler"]
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and pool_state(controller)["pools"]["decode"]["target"] > 1:
            time.sleep(1)
        status = pool_state(controller)
        assert status["pools"]["decode"]["target"] == 1, status["autoscaler"]
        assert traffic.outcomes and all(o == "ok" for o, _ in traffic.outcomes), \
            [o for o in traffic.outcomes if o[0] != "ok"][:3]
        decisions = status["autoscaler"]["decisions"]
        assert decisions and {"observed", "correction", "desired", "action", "current"} <= set(decisions[-1])
        events = [(e["role"], e["event"]) for e in status["events"]]
        assert ("decode", "autoscale") in events and ("decode", "drained") in events
        deadline = time.monotonic() + 15  # the router mirrors the controller every 2 s
        while 'pdserve_autoscaler_target_replicas{pool="decode"} 1.0' not in (metrics := get(url + "/metrics")[1]):
            assert time.monotonic() < deadline, metrics[-1500:]
            time.sleep(0.5)
        assert "pdserve_autoscaler_correction" in metrics
    finally:
        stop_service(controller)
