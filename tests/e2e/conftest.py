"""A real Ray cluster (started in this test process), the cluster controller, real worker
actors and the router, reached over HTTP."""

import os
import time
import urllib.request

import pytest

from pdserve.testkit.workers import free_port


def wait_http(url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready")


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from pdserve.cluster.ray_cluster import init_private_cluster

    init_private_cluster(num_cpus=16)  # loopback, token auth: as `pdserve up` runs it
    yield ray
    ray.shutdown()


def start_service(model_dir, **overrides):
    """Create the controller with a test config; returns (controller handle, base URL). Both
    pools share a fresh second-KV-tier directory unless `overrides` set a pool's tier."""
    import tempfile

    import ray

    from pdserve.cluster.config import load_config
    from pdserve.cluster.controller import create_controller

    left = service_actors()
    assert not left, f"an earlier service left {describe(left)} on this Ray cluster"
    tier_directory = tempfile.mkdtemp(prefix="service-", dir=os.environ.get("PDSERVE_KV_TIER_DIR"))
    settings = {
        "model": str(model_dir), "served_model_name": "tiny", "worker_host": "127.0.0.1",
        "health_check_interval_s": 0.5, "kv_transfer_timeout_s": 10,
        "router.port": free_port(), "prefill.num_cpus": 0.5, "decode.num_cpus": 0.5,
        "router.admin_token": "secret-token", "drain_timeout_s": 60,
        "local_prefill_max_tokens": 0,  # the tests are of the split: every prompt goes to a prefill worker
    }
    settings.update(overrides)
    for pool in ("prefill", "decode"):  # the tier (on by default) in a store of this service's own
        engine = settings.get(f"{pool}.engine")
        if not (isinstance(engine, dict) and "kv_tier" in engine):
            settings[f"{pool}.engine.kv_tier.directory"] = tier_directory
    config = load_config(None, settings)
    controller = create_controller(config)
    url = ray.get(controller.start.remote())
    wait_http(url + "/health")
    return controller, url


def service_actors() -> list[str]:
    """The names of the pdserve workers and router replicas Ray still holds."""
    import ray

    from pdserve.cluster.controller import is_service_actor
    from pdserve.cluster.recovery import NAMESPACE

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == NAMESPACE and is_service_actor(a["name"]))


def describe(names: list[str]) -> dict[str, str]:
    """Each service actor's state as it answers `info` (or why it does not)."""
    import ray

    from pdserve.cluster.recovery import NAMESPACE

    out = {}
    for name in names:
        try:
            out[name] = ray.get(ray.get_actor(name, namespace=NAMESPACE).info.remote(), timeout=5)["state"]
        except Exception as exc:  # noqa: BLE001 - dying, or gone meanwhile
            out[name] = type(exc).__name__
    return out


def stop_service(controller) -> None:
    """Shut the service down; it must leave no worker or router replica behind (they are
    detached: a left one would outlive the test and be adopted by the next service's
    restarted controller). The controller lives on while that is checked, until none has
    been seen for 2 s, so that a start it had under way can show itself."""
    import ray

    ray.get(controller.shutdown.remote(), timeout=60)
    deadline, clear_since = time.monotonic() + 15, None  # ray.kill returns before a name is released
    while time.monotonic() < deadline:
        left = service_actors()
        clear_since = None if left else (clear_since or time.monotonic())
        if clear_since is not None and time.monotonic() - clear_since >= 2.0:
            break
        time.sleep(0.2)
    ray.kill(controller)
    if left:
        from pdserve.cluster.controller import kill_service_actors

        found = describe(left)
        kill_service_actors()  # the failure stays this test's: the next service starts on a clean cluster
        raise AssertionError(f"the service's shutdown left {found} running")


@pytest.fixture(scope="module")
def service(ray_cluster, tiny_llama_dir):
    controller, url = start_service(tiny_llama_dir)
    yield {"controller": controller, "url": url, "model": str(tiny_llama_dir)}
    stop_service(controller)
