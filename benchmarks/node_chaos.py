"""Node chaos: benchmarks/chaos.py's method at node granularity. A multi-node Ray cluster on
this host (testkit/nodes.py: every node its own raylet and object store on its own loopback
address) serves online-poisson through pdserve (2 prefill nodes, 2 decode nodes, one worker
each) while, every 60-90 s, a random worker node is removed as a crash removes it (raylet and
every process on it killed at once) and a node with the same label is added back 20-40 s
later. The pool of the lost node shows as short (`pending: no node with room`) until then.

Reports requests, failures, requests whose tokens differ from the offline references
(chaos.py), leaked KV blocks, and per removal: time to detect (removal to the controller's
`died` event) and time back to target (removal, and node added, to the replacement `ready`).
Targets: 0 failed requests, 0 token differences, 0 leaked blocks.

    .venv/bin/python benchmarks/node_chaos.py [--duration 600] [--out benchmarks/results/node_chaos.json]
"""

from __future__ import annotations

import asyncio
import random
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.chaos import MODEL, compare, drive, leaked_blocks, load_under_chaos, migrations  # noqa: E402
from benchmarks.prefix_reuse import WORKLOADS  # noqa: E402
from benchmarks.report import panels, repo_relative, write  # noqa: E402

SETTINGS = {"worker_host": None, "prefill.replicas": 2, "decode.replicas": 2, "prefill.num_cpus": 0.5,
            "decode.num_cpus": 0.5, "prefill.resources": {"prefill": 1}, "decode.resources": {"decode": 1},
            "env": {"OMP_NUM_THREADS": "1"}}


class NodeChaos:
    """Every 60-90 s remove a random worker node; 20-40 s later add a node of its role back.
    Runs on the main thread (Ray's Cluster registers signal handlers as it adds a node)."""

    def __init__(self, nodes, seed: int, started: float) -> None:
        self.nodes, self.rng, self.started, self.events = nodes, random.Random(seed), started, []
        self._next_ip = 10

    def run_until(self, done: threading.Event) -> None:
        while not done.wait(self.rng.uniform(60, 90)):
            name = self.rng.choice([n for n in self.nodes.by_name if n != "head"])
            role = name.split("-")[0]
            event = {"node": name, "role": role, "removed_at_s": self.now()}
            print(f"node chaos: removing {name}", flush=True)
            self.nodes.remove(name)
            self.events.append(event)
            done.wait(self.rng.uniform(20, 40))  # the node comes back even after the load ended
            self._next_ip += 1
            added = f"{role}-{self._next_ip}"
            self.nodes.add(added, f"127.0.0.{self._next_ip}", resources={role: 1})
            event.update(added=added, added_at_s=self.now())
            print(f"node chaos: added {added}", flush=True)

    def now(self) -> float:
        return round(time.time() - self.started, 2)


def recovery(events: list[dict], controller_events: list[dict], started: float) -> list[dict]:
    """Per removal: seconds to the controller's `died` event of that role, and to the next
    `ready` of that role after the node came back."""
    out = []
    for e in events:
        removed = started + e["removed_at_s"]
        died = [c["time"] for c in controller_events if c["role"] == e["role"] and c["event"] == "died"
                and c["time"] >= removed]
        added = started + e["added_at_s"] if "added_at_s" in e else None
        ready = [c["time"] for c in controller_events if c["role"] == e["role"] and c["event"] == "ready"
                 and added is not None and c["time"] >= added]
        out.append({**e, "detect_s": round(died[0] - removed, 2) if died else None,
                    "back_to_target_after_removal_s": round(ready[0] - removed, 2) if ready else None,
                    "back_to_target_after_node_added_s": round(ready[0] - added, 2) if ready else None})
    return out


def wait_for_targets(controller, timeout_s: float = 300) -> None:
    """Until every pool has its target of ready workers (the last node added back)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pools = ray.get(controller.status.remote())["pools"]
        if all(sum(w["state"] == "ready" for w in p["workers"]) == p["target"] for p in pools.values()):
            return
        time.sleep(1.0)


def plot(result: dict, path: Path) -> None:
    with panels(path, 1, width=9) as (ax,):
        timeline = result["timeline"]
        ok = [(t, ttft) for t, ttft, failed in timeline if not failed and ttft is not None]
        ax.scatter([t for t, _ in ok], [v for _, v in ok], s=6, label="TTFT of a completed request")
        ax.scatter([t for t, _, failed in timeline if failed], [0] * sum(f for *_, f in timeline), marker="x",
                   color="red", label="failed request")
        for e in result["removals"]:
            ax.axvline(e["removed_at_s"], color="red", lw=0.8)
            if "added_at_s" in e:
                ax.axvline(e["added_at_s"], color="green", lw=0.8)
        ax.set_xlabel("seconds into the run (red: a node removed, green: a node added)")
        ax.set_ylabel("TTFT (s)")
        s = result["summary"]
        ax.set_title(f"node chaos: {s['requests']} requests, {s['failed']} failed, "
                     f"{s['differing_requests']} differing, {len(result['removals'])} nodes removed")
        ax.legend()


def main() -> None:
    args, rows, refs = load_under_chaos(__doc__.split("\n")[0], 8132, ROOT / "benchmarks/results/node_chaos.json")

    import ray

    from pdserve.cluster.config import load_config
    from pdserve.cluster.controller import create_controller
    from pdserve.testkit.nodes import Nodes

    nodes = Nodes()
    for i, role in enumerate(("prefill", "prefill", "decode", "decode")):
        nodes.add(f"{role}-{i + 3}", f"127.0.0.{i + 3}", resources={role: 1})
    controller = create_controller(load_config(None, {"router.port": args.port, "model": MODEL, **SETTINGS}))
    try:
        url = ray.get(controller.start.remote())
        started = time.time()
        chaos, done, results = NodeChaos(nodes, args.seed, started), threading.Event(), []

        def load() -> None:
            try:
                results.extend(asyncio.run(drive(url, rows, args.duration, args.time_scale)))
            finally:
                done.set()

        traffic = threading.Thread(target=load, daemon=True)
        traffic.start()
        chaos.run_until(done)
        traffic.join()
        wall = time.time() - started
        wait_for_targets(controller)
        leaked = leaked_blocks(controller, timeout_s=120)
        migrated = migrations(url)
        status = ray.get(controller.status.remote())
    finally:
        ray.get(controller.shutdown.remote(), timeout=120)
        ray.kill(controller)
        nodes.shutdown()
    summary = compare(results, refs)
    removals = recovery(chaos.events, status["events"], started)
    result = {"workload": repo_relative(WORKLOADS / "online-poisson.jsonl"), "duration_s": args.duration,
              "wall_s": round(wall, 1), "time_scale": args.time_scale, "seed": args.seed, "summary": summary,
              "migrations": migrated, "leaked_blocks": leaked, "removals": removals,
              "pools_at_end": {role: {"target": p["target"], "ready": sum(w["state"] == "ready" for w in p["workers"]),
                                      "pending": p["pending"]} for role, p in status["pools"].items()},
              "targets_met": summary["failed"] == 0 and summary["differing_requests"] == 0
              and not any(leaked.values()),
              "timeline": [(round(r["sent_s"] - results[0]["sent_s"], 2), r.get("ttft_s"), "error" in r)
                           for r in results]}
    write(result, args.out, plot)


if __name__ == "__main__":
    main()
