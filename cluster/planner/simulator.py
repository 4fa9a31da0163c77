"""Discrete-event simulation of pdserve's pools, following the runtime's policies:

- a prefill instance runs steps of FCFS chunks under `max_num_batched_tokens` (chunked
  prefill, several requests per step); a finished prompt's KV moves to its decode
  instance (transfer time from the profile), and the first token arrives with it;
- a decode instance runs continuous batching: each step admits arrived requests (up to
  `max_num_seqs` and its KV capacity), then every running request makes one token;
- routing: the prefill instance with the fewest queued tokens, the decode instance with
  the fewest requests (the least-loaded policy; the first such instance where several tie),
  found in O(log instances) (_LeastLoaded);
- colocated: one engine per instance doing both, running requests first (decode tokens,
  then prefill chunks under the same budget), as engine.scheduler does; a step takes the
  model of its kind (Profile.step_s: the mixed-step model only where prompt chunks and
  decodes share it), as the serving calibration measures it;
- a decode (or mixed) step that starts while prefill instances compute takes the co-tenancy
  extra of the prompt tokens a second their current steps compute at (Profile.step_s:
  decode_cotenancy_coeffs, mixed_cotenancy; 0 unless calibration measured one);
- a first token reaches its client `first_token_overhead_s` (Profile) after the step that
  made it: serving's fixed cost beside the engines (HTTP, router, RPCs, streaming);
- prefix caching: a request's `cached_len` leading prompt tokens are neither computed nor
  shipped (attention still spans them: the step's Q and, for the part over KV computed
  before the chunk, K); a disaggregated request whose uncached tokens are
  at most `local_prefill_max_tokens` is prefilled on its decode instance, mixed into its
  decode steps, as the decode worker decides.

Returns per-request TTFT and TPOT.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from pdserve.cluster.planner.workload import SimRequest
from pdserve.engine.profile import Profile
from pdserve.engine.stats import percentile


@dataclass
class SimResult:
    ttft_s: list[float]
    tpot_s: list[float]  # requests with more than one output token
    finish_s: float

    def percentile(self, which: str, q: float) -> float:
        value = percentile(getattr(self, which), q)
        return 0.0 if value is None else value

    def attainment(self, ttft_slo: float, tpot_slo: float) -> float:
        """Fraction of requests meeting both SLOs."""
        return attainment(self.requests(), ttft_slo, tpot_slo)

    def requests(self) -> list[tuple[float, float | None]]:
        """(TTFT, TPOT) of every request, in the order simulate() was given them (as a load
        generator returns its results: measured and simulated pair up request by request);
        TPOT None for one output token."""
        return list(zip(self.ttft_s, self._tpot_all, strict=True))

    _tpot_all: list = field(default_factory=list, repr=False)


def attainment(latencies: list[tuple[float | None, float | None]], ttft_slo: float, tpot_slo: float) -> float:
    """Fraction of requests, given as (TTFT, TPOT), meeting both SLOs. A TTFT of None is a
    request that failed (it misses); a TPOT of None one with a single output token."""
    ok = [t is not None and t <= ttft_slo and (p is None or p <= tpot_slo) for t, p in latencies]
    return sum(ok) / len(ok) if ok else 1.0


@dataclass
class _Job:
    req: SimRequest
    remaining_prompt: int
    index: int = 0  # position in the requests given to simulate()
    first_token_s: float = -1.0
    generated: int = 0
    context: int = 0


class _Instance:
    def __init__(self, position: int = 0) -> None:
        self.position = position  # in its pool's list: the tie-break of the least-loaded choice
        self.queue: list[_Job] = []  # prefill: waiting prompts; decode: arrived, not admitted
        self.running: list[_Job] = []
        self.busy = False
        self.load_tokens = 0  # prefill: prompt tokens queued (its least-loaded key)
        self.jobs = 0  # decode: len(queue) + len(running) (its least-loaded key)
        self.rate = 0.0  # prefill: prompt tokens a second of the step it computes


class _LeastLoaded:
    """A pool's least-loaded instance: what min(instances, key=load) returns (the first of
    the least loaded, in the list's order) in O(log n) instead of a scan. A heap of
    (load, position) entries, one pushed whenever an instance's load changes (`changed`);
    an entry whose load is no longer its instance's is stale and dropped when it reaches
    the top, so the top is the least (load, position) of the current loads."""

    def __init__(self, instances: list[_Instance], key: str) -> None:
        self.instances, self.key = instances, key
        self.heap = [(getattr(i, key), i.position) for i in instances]
        heapq.heapify(self.heap)
        self.limit = 4 * len(instances) + 64  # past it, rebuilt from the current loads

    def changed(self, instance: _Instance) -> None:
        heapq.heappush(self.heap, (getattr(instance, self.key), instance.position))
        if len(self.heap) > self.limit:
            self.heap = [(getattr(i, self.key), i.position) for i in self.instances]
            heapq.heapify(self.heap)

    def least(self) -> _Instance:
        heap, instances, key = self.heap, self.instances, self.key
        while True:
            load, position = heap[0]
            instance = instances[position]
            if getattr(instance, key) == load:
                return instance
            heapq.heappop(heap)


def simulate(profile: Profile, requests: list[SimRequest], prefill: int, decode: int,
             colocated: bool = False, local_prefill_max_tokens: int = 0) -> SimResult:
    """Simulate `prefill` + `decode` instances (or `decode` colocated instances)."""
    sim = _Simulation(profile, prefill, decode, colocated, local_prefill_max_tokens)
    return sim.run(requests)


class _Simulation:
    def __init__(self, profile: Profile, prefill: int, decode: int, colocated: bool,
                 local_prefill_max_tokens: int = 0) -> None:
        if decode < 1 or (not colocated and prefill < 1):
            raise ValueError("need at least one instance per pool")
        self.p = profile
        self.colocated = colocated
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.prefills = [] if colocated else [_Instance(k) for k in range(prefill)]
        self.decodes = [_Instance(k) for k in range(decode)]
        self.least_prefill = _LeastLoaded(self.prefills, "load_tokens")
        self.least_decode = _LeastLoaded(self.decodes, "jobs")
        # the prompt tokens a second the prefill pool computes (its busy instances' rates, summed
        # in the pool's order) is only read by a profile with a co-tenancy term; kept until a
        # prefill instance starts or ends a step
        self.rate_used = bool(any(profile.decode_cotenancy_coeffs) or profile.mixed_cotenancy) and bool(self.prefills)
        self.rate, self.rate_stale = 0.0, True
        self.events: list = []
        self.seq = itertools.count()
        self.done: list[_Job] = []

    def push(self, t: float, kind: str, payload) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, payload))

    def run(self, requests: list[SimRequest]) -> SimResult:
        for index, r in enumerate(requests):
            self.push(r.arrival_s, "arrive", _Job(r, r.uncached_len, index))
        now = 0.0
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            if kind == "arrive":
                self._arrive(now, payload)
            elif kind == "kv":
                instance, job = payload
                if job.req.output_len == 1:  # the first token was the last
                    job.finish_s = now
                    self.done.append(job)
                    continue
                self._enqueue_decode(instance, job)
                self._kick(now, instance, decode=True)
            elif kind == "prefill_done":
                self._prefill_step_done(now, payload)
            else:
                self._decode_step_done(now, payload)
        self.done.sort(key=lambda j: j.index)
        overhead = self.p.first_token_overhead_s
        ttft = [j.first_token_s - j.req.arrival_s + overhead for j in self.done]
        tpot_all = [((j.finish_s - j.first_token_s) / (j.req.output_len - 1)) if j.req.output_len > 1 else None
                    for j in self.done]
        return SimResult(ttft, [x for x in tpot_all if x is not None], now, tpot_all)

    # ------------------------------------------------------------ prefill pool
    def _arrive(self, now: float, job: _Job) -> None:
        if self.colocated or job.remaining_prompt <= self.local_prefill_max_tokens:
            instance = self._pick_decode()
            self._enqueue_decode(instance, job)
            self._kick(now, instance, decode=True)
            return
        instance = self._pick_prefill()
        instance.queue.append(job)
        instance.load_tokens += job.remaining_prompt
        self.least_prefill.changed(instance)
        self._kick(now, instance, decode=False)

    def _pick_prefill(self) -> _Instance:
        """The prefill instance with the fewest queued tokens, the first of them on a tie."""
        return self.least_prefill.least()

    def _pick_decode(self) -> _Instance:
        """The decode instance with the fewest requests, the first of them on a tie."""
        return self.least_decode.least()

    def _enqueue_decode(self, instance: _Instance, job: _Job) -> None:
        instance.queue.append(job)
        instance.jobs += 1
        self.least_decode.changed(instance)

    def _prefill_rate(self) -> float:
        """Prompt tokens a second the prefill pool computes, by instance (0.0 where no profile
        term reads it: a rate times a zero co-tenancy term adds nothing)."""
        if not self.rate_used:
            return 0.0
        if self.rate_stale:
            self.rate = sum(i.rate for i in self.prefills if i.busy) / len(self.prefills)
            self.rate_stale = False
        return self.rate

    def _kick(self, now: float, instance: _Instance, decode: bool) -> None:
        if instance.busy:
            return
        if decode:
            self._decode_step(now, instance)
        else:
            self._prefill_step(now, instance)

    def _prefill_step(self, now: float, instance: _Instance) -> None:
        budget, chunks = self.p.max_num_batched_tokens, []
        for job in instance.queue:
            if budget <= 0:
                break
            n = min(job.remaining_prompt, budget)
            chunks.append((job, n))
            budget -= n
        if not chunks:
            return
        tokens, squared, cached = _attention(chunks)
        duration = self.p.prefill_step_s(tokens, squared, cached)
        instance.busy, instance.rate = True, tokens / duration if duration > 0 else 0.0
        self.rate_stale = True
        self.push(now + duration, "prefill_done", (instance, chunks))

    def _prefill_step_done(self, now: float, payload) -> None:
        instance, chunks = payload
        instance.busy = False
        self.rate_stale = True
        for job, n in chunks:
            job.remaining_prompt -= n
            instance.load_tokens -= n
            if job.remaining_prompt == 0:
                instance.queue.remove(job)
                target = self._pick_decode()
                arrival = now + self.p.transfer_s(job.req.uncached_len)
                job.first_token_s = arrival  # the first token reaches the client with the KV
                job.generated, job.context = 1, job.req.prompt_len + 1
                self.push(arrival, "kv", (target, job))
        self.least_prefill.changed(instance)
        self._kick(now, instance, decode=False)

    # ------------------------------------------------------------ decode pool
    def _decode_step(self, now: float, instance: _Instance) -> None:
        self._finish_done(now, instance)
        capacity = self.p.kv_capacity_tokens - sum(j.context for j in instance.running)
        while instance.queue and len(instance.running) < self.p.max_num_seqs:
            job = instance.queue[0]
            need = job.req.prompt_len + job.req.output_len
            if need > capacity and instance.running:
                break
            capacity -= need
            instance.running.append(instance.queue.pop(0))
        if not instance.running:
            return
        rate = self._prefill_rate()
        if self.colocated or any(j.remaining_prompt for j in instance.running):
            duration, chunks = self._colocated_work(instance, rate)
        else:
            duration, chunks = self.p.decode_step_s(len(instance.running),
                                                    sum(j.context for j in instance.running), rate), []
        instance.busy = True
        self.push(now + duration, "decode_done", (instance, chunks))

    def _colocated_work(self, instance: _Instance, prefill_rate: float):
        budget = self.p.max_num_batched_tokens
        decoding = [j for j in instance.running if j.remaining_prompt == 0]
        budget -= len(decoding)
        chunks = []
        for job in instance.running:
            if job.remaining_prompt and budget > 0:
                n = min(job.remaining_prompt, budget)
                chunks.append((job, n))
                budget -= n
        tokens, squared, cached = _attention(chunks)
        duration = self.p.step_s(tokens, squared, len(decoding), sum(j.context for j in decoding), cached,
                                 prefill_rate)
        return duration, chunks

    def _decode_step_done(self, now: float, payload) -> None:
        instance, chunks = payload
        instance.busy = False
        prefilling = {id(job) for job, _ in chunks}
        for job, n in chunks:
            job.remaining_prompt -= n
            if job.remaining_prompt == 0:
                job.first_token_s, job.generated, job.context = now, 1, job.req.prompt_len + 1
        for job in instance.running:
            if job.remaining_prompt == 0 and id(job) not in prefilling:
                job.generated += 1
                job.context += 1
        self._decode_step(now, instance)

    def _finish_done(self, now: float, instance: _Instance) -> None:
        still = []
        for job in instance.running:
            if job.remaining_prompt == 0 and job.generated >= job.req.output_len:
                job.finish_s = now
                self.done.append(job)
            else:
                still.append(job)
        if len(still) != len(instance.running):
            instance.jobs -= len(instance.running) - len(still)
            self.least_decode.changed(instance)
        instance.running = still


def _attention(chunks: list[tuple[_Job, int]]) -> tuple[int, int, int]:
    """(T, Q, K) of a step computing `chunks` (job, n tokens from where its prompt stands),
    as engine.step_log.StepShape counts them."""
    tokens = squared = cached = 0
    for job, n in chunks:
        start = job.req.prompt_len - job.remaining_prompt
        tokens, squared, cached = tokens + n, squared + n * (start + n), cached + n * start
    return tokens, squared, cached
