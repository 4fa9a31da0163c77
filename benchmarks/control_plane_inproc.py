"""The control plane's in-process parts, at any number of workers (benchmarks/control_plane.py):
the router's own components (registry, cache index, cache-aware policy) over N synthetic
workers, the autoscaler's decision and the planner's simulator. No worker process, no
socket: the synthetic workers' updates (load and cache deltas, as their `Watch` streams
push them) go through the registry's own `apply`, so the router's state is built by the code
that builds it when serving.

Every figure here is "in-process": it is the router's (or the planner's) CPU cost alone,
without gRPC or HTTP, on whatever share of the machine's cores the process gets.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
import tracemalloc

from pdserve.engine.block_hash import prefix_hashes, root_hash
from pdserve.engine.cache_events import key64
from pdserve.engine.stats import percentile
from pdserve.protos import pdserve_pb2 as pb
from pdserve.router.cache_index import CacheIndex, PromptKeys
from pdserve.router.config import RouterConfig
from pdserve.router.registry import WorkerRegistry
from pdserve.router.state import Router
from pdserve.rpc.security import Security

BLOCK_SIZE = 16
ROOT = root_hash("control-plane-benchmark")  # every worker of one model and dtype shares its root
PREFILL_SHARE = 4  # one worker in four is a prefill worker (README's sim example: 4P + 12D)
HELD_BLOCKS = 2000  # unrelated blocks each synthetic worker holds besides the test prompts
STATES = ("cold", "one", "hot")  # the prompt's prefix held by no worker, by one per pool, by every worker
CHURN = 32  # blocks stored and as many evicted per worker update (events/s test)


def members(n: int) -> list[dict]:
    """`n` workers as the controller lists them: one in PREFILL_SHARE prefill, the rest decode
    (at least one of each)."""
    prefill = max(1, n // PREFILL_SHARE)
    return [{"role": "prefill" if i < prefill else "decode", "worker_id": f"w{i:04d}", "address": f"127.0.0.1:{i + 1}",
             "state": "ready"} for i in range(n)]


def random_keys(rng: random.Random, count: int) -> list[int]:
    return [rng.getrandbits(64) for _ in range(count)]


def prompt_keys(ids: list[int]) -> list[int]:
    """The block keys a worker reports for `ids` (all tokens but the last, as the index asks)."""
    return [key64(h) for h in prefix_hashes(ids[:-1], BLOCK_SIZE, ROOT)]


def worker_stats(rng: random.Random, worker_id: str, role: str) -> pb.WorkerStats:
    """A load report as a busy worker sends it (random load, a few cached blocks)."""
    total = 5000
    free = rng.randrange(total // 4, total)
    return pb.WorkerStats(worker_id=worker_id, role=role, num_running=rng.randrange(0, 16),
                          num_waiting=rng.randrange(0, 3), num_free_blocks=free, num_total_blocks=total,
                          queued_prefill_tokens=rng.randrange(0, 4096) if role == "prefill" else 0)


def churn_updates(rng: random.Random) -> list[tuple[list[int], list[int]]]:
    """Two deltas (stored, removed) that undo each other (CHURN blocks stored, CHURN evicted),
    so a worker's held set keeps its size however many updates come."""
    a, b = random_keys(rng, CHURN), random_keys(rng, CHURN)
    return [(a, b), (b, a)]


def cache_update(registry: WorkerRegistry, worker_id: str, stats: pb.WorkerStats, stored: list[int],
                 removed: list[int] = (), reset: bool = False) -> pb.WorkerUpdate:
    """The update a worker pushes with these cache changes, following the index's cursor."""
    since = 0 if reset else registry.cache_index.cursor(worker_id)
    return pb.WorkerUpdate(stats=stats, cache=pb.CacheEventsReply(
        since=since, next_cursor=since + len(stored) + len(removed), reset=reset, stored=stored, removed=removed))


async def synthetic_router(n: int, holders: dict[str, list[int]]) -> Router:
    """A Router over `n` synthetic workers, its registry filled by their first updates (through
    `apply`, as when serving): each worker holds HELD_BLOCKS random blocks plus the keys
    `holders` lists for it (worker id -> keys)."""
    rng = random.Random(n)
    listed = members(n)

    async def source() -> list[dict]:
        return listed

    config = RouterConfig(model="control-plane-benchmark", security=Security("b" * 32))
    registry = WorkerRegistry(source, config.security)
    registry.model.ready.set()  # no Info round to learn the model: nothing listens at these addresses
    await registry.refresh()
    for m in listed:
        view = registry._views[m["worker_id"]]
        view.watch.cancel()  # not started yet: nothing listens at these addresses; updates come below
        view.caches = True
        registry.cache_index.add_worker(view.worker_id, ROOT, BLOCK_SIZE)
        held = random_keys(rng, HELD_BLOCKS) + holders.get(m["worker_id"], [])
        registry.apply(view, cache_update(registry, view.worker_id, worker_stats(rng, view.worker_id, view.role),
                                          held, reset=True))
        view.heard_at = float("inf")  # never silent: no heartbeats come in this benchmark
    return Router(config, registry)


def prompts_and_holders(n: int, lengths: tuple[int, ...]) -> tuple[dict, dict[str, list[int]]]:
    """Per (state, length) a prompt's token ids, and which workers hold which prompt's blocks:
    "hot" prompts every worker, "one" prompts the first prefill and the first decode worker,
    "cold" prompts none."""
    rng = random.Random(7)
    prompts = {(state, length): [rng.randrange(3, 49152) for _ in range(length)]
               for state in STATES for length in lengths}
    listed = members(n)
    holders: dict[str, list[int]] = {m["worker_id"]: [] for m in listed}
    first_decode = next(m["worker_id"] for m in listed if m["role"] == "decode")
    for (state, _), ids in prompts.items():
        keys = prompt_keys(ids)
        owners = list(holders) if state == "hot" else [listed[0]["worker_id"], first_decode] if state == "one" else []
        for worker_id in owners:
            holders[worker_id].extend(keys)
    return prompts, holders


def time_decisions(router: Router, ids: list[int], budget_s: float, max_reps: int) -> list[float]:
    """Seconds per routing decision as the app makes one: hash the prompt's blocks
    (PromptKeys), look every routable worker up in the cache index (route_request), pick the
    decode worker and order the prefill workers. At least 30 decisions, then until
    `budget_s` or `max_reps`. The router's state is left as it was (nothing is noted routed)."""
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < max_reps and (len(times) < 30 or time.perf_counter() < deadline):
        start = time.perf_counter()
        route = router.route_request(PromptKeys(ids), None)
        decode = router.pick_decode(route)
        router.order_prefill(route, decode)
        times.append(time.perf_counter() - start)
    return times


def hash_seconds(ids: list[int], reps: int = 20) -> float:
    """Median seconds to compute one prompt's block keys (the part no worker count changes)."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        PromptKeys(ids).keys(ROOT, BLOCK_SIZE)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def _routing_at(n: int, lengths: tuple[int, ...], budget_s: float, max_reps: int) -> tuple[list[dict], dict]:
    """Decision times at `n` workers, one row per (state, length); and the prompts."""
    prompts, holders = prompts_and_holders(n, lengths)
    router = await synthetic_router(n, holders)
    rows = []
    try:
        for (state, length), ids in prompts.items():
            times = time_decisions(router, ids, budget_s, max_reps)
            rows.append({"workers": n, "prompt_tokens": length, "state": state, "decisions": len(times),
                         "p50_us": 1e6 * statistics.median(times), "p99_us": 1e6 * percentile(times, 99)})
    finally:
        await router.registry.stop()
    return rows, prompts


def routing(sizes: tuple[int, ...], lengths: tuple[int, ...], budget_s: float, max_reps: int) -> dict:
    """Routing decision time (p50/p99, microseconds) per worker count, prompt length and cache
    state, and the prompt-hashing share of it."""
    rows = []
    for n in sizes:
        cells, prompts = asyncio.run(_routing_at(n, lengths, budget_s, max_reps))
        rows += cells
    hashing = {str(length): 1e6 * hash_seconds(prompts["cold", length]) for length in lengths}
    return {"in_process": True, "rows": rows, "hash_us": hashing, "held_blocks_per_worker": HELD_BLOCKS,
            "prefill_share": f"1 in {PREFILL_SHARE}", "block_size": BLOCK_SIZE}


async def _absorb_at(n: int, rounds: int) -> dict:
    router = await synthetic_router(n, {})
    registry = router.registry
    views = list(registry._views.values())
    churn = {v.worker_id: churn_updates(random.Random(v.worker_id)) for v in views}

    def one_round(i: int) -> None:
        for view in views:
            stored, removed = churn[view.worker_id][i % 2]
            registry.apply(view, cache_update(registry, view.worker_id, view.stats, stored, removed))

    try:
        one_round(0)  # warm
        start, cpu = time.perf_counter(), time.process_time()
        for i in range(rounds):
            one_round(i + 1)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    finally:
        await registry.stop()
    assert registry.resyncs == 0
    events = rounds * n * 2 * CHURN
    return {"workers": n, "events": events, "events_per_s": events / wall, "poll_s": wall / rounds,
            "cpu_s_per_event": cpu / events}


def index_absorb(sizes: tuple[int, ...], polls: int) -> list[dict]:
    """Cache events the registry absorbs per second through `apply` (one round: every worker's
    update carrying CHURN stored + CHURN evicted keys, each built and applied), per worker
    count; no network."""
    return [asyncio.run(_absorb_at(n, polls)) for n in sizes]


def index_memory(workers: int = 64, blocks: int = 5000, expected: int = 50_000) -> dict:
    """Bytes the cache index takes per block a worker reported (`held`) and per block it
    was only expected to hold (`expected`), measured with tracemalloc."""
    rng = random.Random(3)
    stored = [random_keys(rng, blocks) for _ in range(workers)]
    tracemalloc.start()
    index = CacheIndex()
    before = tracemalloc.get_traced_memory()[0]
    for i, keys in enumerate(stored):
        index.add_worker(f"w{i}", ROOT, BLOCK_SIZE)
        index.apply(f"w{i}", 1, True, keys, [])
    held = tracemalloc.get_traced_memory()[0] - before
    prompt = PromptKeys([rng.randrange(3, 49152) for _ in range(expected * BLOCK_SIZE + 1)])
    prompt.keys(ROOT, BLOCK_SIZE)  # hashed outside the measurement
    index.add_worker("expected", ROOT, BLOCK_SIZE)
    before = tracemalloc.get_traced_memory()[0]
    index.expect("expected", prompt)
    expected_bytes = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    per_held = held / (workers * blocks)
    return {"workers": workers, "blocks_per_worker": blocks, "bytes_per_held_block": per_held,
            "bytes_per_expected_block": expected_bytes / expected,
            "mib_per_worker": {f"{b}_blocks": per_held * b / 2**20 for b in (5_000, 50_000, 1 << 22)},
            "note": "1<<22 is CacheIndex.max_held, past which a worker is re-read from scratch"}


def request_lengths(count: int, seed: int = 11) -> list[tuple[int, int, int]]:
    """(prompt, output, cached) tokens: prompts of 128-1024 tokens, 64-256 out, three in ten
    with half their prompt cached."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        prompt = rng.choice((128, 256, 512, 1024))
        cached = (prompt // 2) // BLOCK_SIZE * BLOCK_SIZE if rng.random() < 0.3 else 0
        out.append((prompt, rng.choice((64, 128, 256)), cached))
    return out


class PlannerBench:
    """The planner's profile (the simulated engine's, engine/sim_profile.json), the SLO, and
    what one instance of each phase sustains on `request_lengths`; an N-worker plan is the
    one the planner makes for the rate N workers serve (pools sized by those capacities)."""

    def __init__(self) -> None:
        from pdserve.cluster.planner.search import SLO, phase_curve
        from pdserve.engine.profile import Profile
        from pdserve.engine.sim import DEFAULT_PROFILE

        self.profile, self.slo = Profile.load(DEFAULT_PROFILE), SLO(2.0, 0.15, 90.0)
        self.lengths = request_lengths(300)
        self.capacity = {"prefill": phase_curve(self.profile, self.lengths, "prefill").capacity(self.slo, True, False),
                         "decode": phase_curve(self.profile, self.lengths, "decode").capacity(self.slo, False, True)}

    def rate(self, n: int) -> float:
        """The request rate whose plan needs `n` workers in all."""
        return n / (1 / self.capacity["prefill"] + 1 / self.capacity["decode"])

    def pool_sizes(self, n: int) -> tuple[int, int]:
        prefill = max(1, min(n - 1, round(self.rate(n) / self.capacity["prefill"])))
        return prefill, n - prefill

    def simulator(self, n: int, seconds: float) -> dict:
        """Requests/s the simulator replays for an N-worker plan: `seconds` of Poisson
        arrivals at the plan's rate, simulated once, timed."""
        from pdserve.cluster.planner.simulator import simulate
        from pdserve.cluster.planner.workload import poisson

        prefill, decode = self.pool_sizes(n)
        work = poisson(self.rate(n), max(50, round(self.rate(n) * seconds)), self.lengths, seed=2)
        start = time.perf_counter()
        simulate(self.profile, work, prefill, decode)
        wall = time.perf_counter() - start
        return {"workers": n, "prefill": prefill, "decode": decode, "rate": self.rate(n), "requests": len(work),
                "wall_s": wall, "requests_per_s": len(work) / wall}

    def autoscaler(self, n: int, reps: int) -> dict:
        """Seconds per autoscaler decision with N workers in the pools, on the observations the
        router hands it (its latest 500 requests, arriving at the plan's rate)."""
        from pdserve.cluster.autoscaler import Autoscaler

        prefill, decode = self.pool_sizes(n)
        rate = self.rate(n)
        lengths = request_lengths(500, seed=n)
        observed = {"count": 500, "rate": rate, "lengths": lengths, "arrivals": [i / rate for i in range(500)],
                    "ttft_p": 0.8, "tpot_p": 0.08, "hit_rate": 0.15, "inflight": 0}
        scaler = Autoscaler(self.profile, self.slo, {"prefill": (0, 4096), "decode": (1, 4096)}, cooldown_s=0.0)
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            decision = scaler.decide(observed, {"prefill": prefill, "decode": decode})
            times.append(time.perf_counter() - start)
        return {"workers": n, "decision_s": statistics.median(times), "reps": reps, "desired": decision.desired}
