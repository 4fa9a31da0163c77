"""The planner simulator's least-loaded choices (a heap per pool, O(log instances) a choice)
against the linear scans they replaced: min() over the pool's list by the load read from
each instance's own queues, the first of the least loaded on a tie, and the prefill pool's
rate summed afresh at every decode step. Same choices, in the same order, and the same
results to the bit, on random plans and workloads (bursts of simultaneous arrivals make
ties), with and without a co-tenancy term, disaggregated, local prefill and colocated."""

import random
from dataclasses import replace

import pytest

from pdserve.cluster.planner import simulator
from pdserve.cluster.planner.workload import SimRequest
from pdserve.engine.profile import Profile

PROFILE = Profile("test", (0.02, 0.0025, 1e-8), (0.03, 0.0015, 2e-6), 46080, 1.5e9,
                  max_num_batched_tokens=512, max_num_seqs=8, kv_capacity_tokens=4000)
COTENANT = replace(PROFILE, decode_cotenancy_coeffs=(1e-6, 1e-7, 1e-9), mixed_cotenancy=1e-5)


class Recording(simulator._Simulation):
    """The simulator as it is, noting every choice (pool, position)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.choices: list[tuple[str, int]] = []

    def _pick_prefill(self):
        instance = super()._pick_prefill()
        self.choices.append(("prefill", instance.position))
        return instance

    def _pick_decode(self):
        instance = super()._pick_decode()
        self.choices.append(("decode", instance.position))
        return instance


class Scanning(Recording):
    """The previous algorithm: linear scans over the pools' current state."""

    last_on_tie = False  # a wrong tie-break, to show the comparison catches one

    def _scan(self, pool, key):
        if self.last_on_tie:
            return min(reversed(pool), key=key)
        return min(pool, key=key)

    def _pick_prefill(self):
        instance = self._scan(self.prefills, lambda i: i.load_tokens)
        self.choices.append(("prefill", instance.position))
        return instance

    def _pick_decode(self):
        instance = self._scan(self.decodes, lambda i: len(i.running) + len(i.queue))
        self.choices.append(("decode", instance.position))
        return instance

    def _prefill_rate(self) -> float:
        return sum(i.rate for i in self.prefills if i.busy) / len(self.prefills) if self.prefills else 0.0


class WrongTies(Scanning):
    last_on_tie = True


def random_case(seed: int):
    rng = random.Random(seed)
    requests, t = [], 0.0
    for _ in range(rng.randrange(1, 150)):
        t += 0.0 if rng.random() < 0.4 else rng.expovariate(rng.choice((5.0, 40.0)))
        prompt = rng.choice((16, 64, 300, 700, 1500))
        cached = (prompt // 2) // 16 * 16 if rng.random() < 0.3 else 0
        requests.append(SimRequest(t, prompt, rng.choice((1, 2, 10, 60)), cached_len=cached))
    colocated = rng.random() < 0.25
    prefill = 0 if colocated else rng.randrange(1, 12)
    args = (rng.choice((PROFILE, COTENANT)), prefill, rng.randrange(1, 12), colocated,
            rng.choice((0, 0, 64, 400)))
    return args, requests


def run(cls, args, requests):
    sim = cls(*args)
    result = sim.run(requests)
    return sim.choices, (result.ttft_s, result._tpot_all, result.finish_s)


@pytest.mark.parametrize("block", range(4))
def test_choices_and_results_match_the_linear_scans(block):
    for seed in range(block * 60, (block + 1) * 60):
        args, requests = random_case(seed)
        choices, result = run(Recording, args, requests)
        assert run(Scanning, args, requests) == (choices, result), f"seed {seed}"
        # and simulate() is the recorded run
        plain = simulator.simulate(args[0], requests, *args[1:])
        assert (plain.ttft_s, plain._tpot_all, plain.finish_s) == result, f"seed {seed}"


def test_the_comparison_catches_a_different_tie_break():
    """Ties are frequent in these workloads: taking the last of the least loaded instead of
    the first changes the choices (and so would fail the test above)."""
    differ = sum(run(WrongTies, *random_case(seed))[0] != run(Scanning, *random_case(seed))[0]
                 for seed in range(40))
    assert differ >= 10


def test_least_loaded_is_min_over_the_pool_under_random_changes():
    """The heap against min() over many random load changes, past its rebuild limit."""
    rng = random.Random(5)
    for size in (1, 2, 7, 64):
        pool = [simulator._Instance(k) for k in range(size)]
        least = simulator._LeastLoaded(pool, "jobs")
        for _ in range(3000):
            instance = rng.choice(pool)
            instance.jobs = max(0, instance.jobs + rng.choice((-2, -1, 1, 1, 3)))
            least.changed(instance)
            assert least.least() is min(pool, key=lambda i: i.jobs)
            assert len(least.heap) <= least.limit
