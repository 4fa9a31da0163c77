"""KV between nodes on both transports, with no user setting: a 3-node Ray on this host
(testkit/nodes.py: head, a prefill node and a decode node, each on its own loopback address),
`worker_host: null` and no GLOO_SOCKET_IFNAME, serving SmolLM2-135M with `kv_transport: torch`
(gloo) and then `grpc`. For each: the same greedy requests through the router; the decode
worker must have received the prompts' KV from the prefill worker on the other node (bytes
received, remote prefill decisions, no failed transfer), and both transports must give the
same tokens.

    .venv/bin/python benchmarks/cross_node_kv.py [--out benchmarks/results/cross_node_kv.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.report import write  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "List three prime numbers:"]


def run_transport(transport: str, port: int) -> dict:
    """Start the service with `transport`, send PROMPTS, read the decode worker's counters."""
    import json
    import urllib.request

    import ray

    from pdserve.cluster.config import load_config
    from pdserve.cluster.controller import create_controller

    config = load_config(None, {"model": MODEL, "router.port": port, "worker_host": None, "kv_transport": transport,
                                "local_prefill_max_tokens": 0, "prefill.resources": {"prefill": 1},
                                "decode.resources": {"decode": 1}, "prefill.num_cpus": 0.5, "decode.num_cpus": 0.5})
    controller = create_controller(config)
    try:
        url = ray.get(controller.start.remote())
        outputs = []
        started = time.perf_counter()
        for prompt in PROMPTS:
            body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                               "return_token_ids": True}).encode()
            request = urllib.request.Request(url + "/v1/completions", data=body,
                                             headers={"content-type": "application/json"})
            with urllib.request.urlopen(request, timeout=300) as response:
                outputs.append(json.loads(response.read())["choices"][0]["token_ids"])
        seconds = time.perf_counter() - started
        pools = ray.get(controller.status.remote())["pools"]
    finally:
        ray.get(controller.shutdown.remote(), timeout=120)
        ray.kill(controller)
    decode, prefill = pools["decode"]["workers"][0], pools["prefill"]["workers"][0]
    stats = decode["stats"]
    return {"transport": transport, "prefill_node": prefill["node"], "decode_node": decode["node"],
            "prefill_address": prefill["address"], "decode_address": decode["address"],
            "kv_bytes_received": stats["kv_bytes_received"],
            "kv_bytes_sent_by_prefill": prefill["stats"]["kv_bytes_sent"],
            "failed_transfers": stats["num_failed_transfers"], "prefill_decisions": stats["prefill_decisions"],
            "requests_s": round(seconds, 2), "token_ids": outputs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=8133)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/cross_node_kv.json")
    args = parser.parse_args()
    import os

    assert not os.environ.get("GLOO_SOCKET_IFNAME"), "this run shows that no GLOO_SOCKET_IFNAME is needed"
    from pdserve.testkit.nodes import Nodes

    nodes = Nodes()
    try:
        nodes.add("prefill", "127.0.0.3", resources={"prefill": 1})
        nodes.add("decode", "127.0.0.4", resources={"decode": 1})
        runs = [run_transport(t, args.port) for t in ("torch", "grpc")]
    finally:
        nodes.shutdown()
    ok = all(r["prefill_node"] != r["decode_node"] and r["kv_bytes_received"] > 0 and not r["failed_transfers"]
             for r in runs) and runs[0]["token_ids"] == runs[1]["token_ids"]
    write({"model": MODEL, "prompts": PROMPTS, "runs": runs, "both_transports_ship_kv_between_nodes": ok},
          args.out)


if __name__ == "__main__":
    main()
