"""A real multi-node Ray cluster on this one host, as Ray's own tests build them
(`ray.cluster_utils.Cluster`): every node its own raylet, object store and resources, each
on its own loopback address (127.0.0.2, .3, ...), token auth on. `remove` kills a node the
way a crash does. Used by tests/cluster and benchmarks/node_chaos.py."""

from __future__ import annotations

HEAD_IP = "127.0.0.2"


class Nodes:
    """The cluster's nodes by name; `add` and `remove` as an operator's machines come and go."""

    def __init__(self) -> None:
        import ray
        from ray.cluster_utils import Cluster

        from pdserve.cluster.ray_cluster import ensure_token, ray_env

        assert not ray.is_initialized(), "a multi-node cluster needs a Ray of its own in this process"
        ray_env(local=False)  # token auth on; node addresses as given, not rewritten
        ensure_token()
        self.cluster = Cluster()
        self.by_name: dict = {}
        self.add("head", HEAD_IP, num_cpus=2)
        ray.init(address=self.cluster.address, _node_ip_address=HEAD_IP, namespace="pdserve",
                 logging_level="WARNING", log_to_driver=False)

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def add(self, name: str, ip: str, num_cpus: float = 1, resources: dict | None = None):
        node = self.cluster.add_node(node_ip_address=ip, num_cpus=num_cpus, resources=resources or {},
                                     object_store_memory=100 * 1024 * 1024)
        self.by_name[name] = node
        return node

    def remove(self, name: str) -> None:
        self.cluster.remove_node(self.by_name.pop(name), allow_graceful=False)

    def name_of(self, ip: str) -> str:
        return next(name for name, node in self.by_name.items() if node.node_ip_address == ip)

    def shutdown(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()
