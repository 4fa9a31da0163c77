"""Connecting to Ray, starting a local head node when there is none, and stopping it again."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from engine.model_source import cache_dir

logger = logging.getLogger(__name__)
NAMESPACE = "pdserve"


def _state_file() -> Path:
    return cache_dir() / "ray-started-by-pdserve"


def ray_env() -> None:
    """Defaults that make a local Ray usable: no usage stats; auth mode set explicitly
    (Ray >= 2.59 enables token auth for local clusters, and `ray status` then fails)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def ray_executable() -> str:
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.exists() else (shutil.which("ray") or "ray")


def connect(address: str | None, start_if_missing: bool = False, num_cpus: int | None = None) -> bool:
    """Connect this process to Ray; returns True if it started a local head node."""
    import ray

    ray_env()
    if address:
        ray.init(address=address, namespace=NAMESPACE, logging_level="WARNING", log_to_driver=False)
        return False
    try:
        ray.init(address="auto", namespace=NAMESPACE, logging_level="WARNING", log_to_driver=False)
        return False
    except ConnectionError:
        if not start_if_missing:
            raise ValueError("no Ray cluster is running here; start the service with `pdserve up`") from None
    cpus = num_cpus or os.cpu_count() or 1
    logger.warning("starting a local Ray head node (%d CPUs)", cpus)
    subprocess.run([ray_executable(), "start", "--head", f"--num-cpus={cpus}", "--include-dashboard=false",
                    "--disable-usage-stats", "--object-store-memory=500000000"],
                   check=True, stdout=subprocess.DEVNULL)
    _state_file().parent.mkdir(parents=True, exist_ok=True)
    _state_file().write_text("1")
    ray.init(address="auto", namespace=NAMESPACE, logging_level="WARNING", log_to_driver=False)
    return True


def stop_local_ray_if_ours() -> bool:
    """`ray stop` if `pdserve up` started this node's Ray; returns whether it did."""
    if not _state_file().exists():
        return False
    subprocess.run([ray_executable(), "stop", "--force"], check=False, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    _state_file().unlink(missing_ok=True)
    return True
