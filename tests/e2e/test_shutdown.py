"""Shutting a service down leaves nothing of it on the Ray cluster, even when it comes in the
middle of workers' starts. (Its own module: `stop_service` checks that no worker or router
replica is left on the cluster, so no other service may run beside it.)"""

from pdserve.cluster.recovery import NAMESPACE, WORKER_PREFIX
from tests.e2e.conftest import service_actors, start_service, stop_service
from tests.e2e.test_scaling import wait_until


def test_a_service_shut_down_while_its_workers_start_leaves_none_behind(ray_cluster, tiny_llama_dir):
    """Shutdown stops a worker in the middle of its start() (a real model's: seconds, where a
    simulated one's takes milliseconds); that start then fails, and the controller must not
    launch replacements (detached, they would outlive the service and be adopted by a later
    controller). `stop_service` asserts that no worker or router replica is left."""
    import ray

    controller, _ = start_service(tiny_llama_dir)
    stopped = False
    try:
        running = set(service_actors())
        ray.get(controller.scale.remote(decode=3, wait=False), timeout=60)

        def mid_start() -> bool:
            new = [n for n in service_actors() if n.startswith(WORKER_PREFIX) and n not in running]
            states = ray.get([ray.get_actor(n, namespace=NAMESPACE).info.remote() for n in new], timeout=30)
            return any(s["state"] == "starting" for s in states)

        wait_until(mid_start, "a new worker is in its start()", 60)
        stopped = True
        stop_service(controller)
    finally:
        if not stopped:
            stop_service(controller)
