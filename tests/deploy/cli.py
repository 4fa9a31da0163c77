"""Running the `pdserve` command as an operator does: a subprocess in a directory away from
the checkout, with none of the test session's Ray settings, and its own run directory (where
`pdserve up` records the local Ray it started), so a test never meets another pdserve."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

PDSERVE = str(Path(sys.executable).parent / "pdserve")


def operator_env(run_dir: Path) -> dict:
    """This machine's environment less every RAY_* variable: what pdserve sets, it sets itself."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(PDSERVE_RUN_DIR=str(run_dir), RAY_USAGE_STATS_ENABLED="0")
    return env


def pdserve(run_dir: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([PDSERVE, *args], cwd=run_dir, env=operator_env(run_dir), capture_output=True,
                          text=True, timeout=timeout)


def up_args(model_dir: Path, port: int) -> list[str]:
    return ["up", "--model", str(model_dir), "--port", str(port), "--set", "served_model_name=tiny",
            "--set", "prefill.num_cpus=0.5",
            "--set", "decode.num_cpus=0.5"]


class ForegroundUp:
    """`pdserve up` in the foreground (as `make serve` runs it), its output in a file."""

    def __init__(self, run_dir: Path, model_dir: Path, port: int) -> None:
        self.log_path = run_dir / "up.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([PDSERVE, *up_args(model_dir, port)], cwd=run_dir, env=operator_env(run_dir),
                                     stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_serving(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while "pdserve is serving" not in self.log():
            assert self.proc.poll() is None, f"`pdserve up` exited {self.proc.returncode}: {self.log()[-3000:]}"
            assert time.monotonic() < deadline, f"`pdserve up` not serving after {timeout_s}s: {self.log()[-3000:]}"
            time.sleep(0.5)

    def wait_exit(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"`pdserve up` still running after {timeout_s}s: {self.log()[-3000:]}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self._log.close()


def recorded_ray(run_dir: Path):
    """The LocalRay that `pdserve up` recorded in `run_dir`."""
    from pdserve.cluster.ray_cluster import LocalRay

    return LocalRay(**json.loads((run_dir / "local-ray.json").read_text()))


_CLIENT = """
import sys, ray
try:
    ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
    print("ACCEPTED", ray.get(ray.remote(num_cpus=0)(lambda: 6 * 7).remote()))  # whatever the pools hold
except Exception:
    print("REFUSED")
"""


def ray_client(address: str, **env: str) -> str:
    """Connect a Ray driver to `address` with `env` on top of a clean environment and run one
    task: "ACCEPTED 42", or "REFUSED" when it cannot join."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    clean.update(RAY_USAGE_STATS_ENABLED="0", RAY_gcs_rpc_server_connect_timeout_s="5", **env)
    out = subprocess.run([sys.executable, "-c", _CLIENT, address], env=clean, capture_output=True, text=True,
                         timeout=180)
    return (out.stdout.strip().splitlines() or [out.stderr[-500:]])[-1]
