"""A real multi-node Ray cluster on this one host, as Ray's own tests build them
(`ray.cluster_utils.Cluster`): every node its own raylet, object store and resources, each
on its own loopback address (127.0.0.2, .3, ...), token auth on; `remove_node` kills a node
the way a crash does. pdserve's controller, router and pools run on it with `worker_host:
null` (each worker listens on its node's address) and no GLOO_SOCKET_IFNAME."""

from __future__ import annotations

import pytest

from pdserve.testkit.nodes import Nodes
from pdserve.testkit.workers import CLUSTER_TOKEN


@pytest.fixture(scope="module")
def nodes():
    """head (no pool resources); one prefill node; two decode nodes, room for two workers each."""
    cluster = Nodes()
    cluster.add("prefill-1", "127.0.0.3", resources={"prefill": 2})
    cluster.add("decode-a", "127.0.0.4", resources={"decode": 2})
    cluster.add("decode-b", "127.0.0.5", resources={"decode": 2})
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def service(nodes, tiny_llama_dir):
    from tests.e2e.conftest import start_service, stop_service

    controller, url = start_service(tiny_llama_dir, **{
        "worker_host": None, "cluster_token": CLUSTER_TOKEN,  # the test reads workers' Stats itself
        "prefill.resources": {"prefill": 1}, "decode.resources": {"decode": 1}, "decode.replicas": 2,
        "prefill.num_cpus": 0.25, "decode.num_cpus": 0.25,
        # every request is computed in full by a prefill worker: no cache makes a leg trivially short
        "prefill.engine": {"enable_prefix_caching": False, "max_num_batched_tokens": 16},
        "decode.engine": {"enable_prefix_caching": False}})
    yield {"controller": controller, "url": url}
    stop_service(controller)
