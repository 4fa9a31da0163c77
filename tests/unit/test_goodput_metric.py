"""The router's SLO gauges and goodput counter (router.metrics), fed finished requests whose
TTFT and TPOT are set by hand (a stand-in for router.generation.Generation: only `started`,
`prompt_ids` and `result` are read)."""

from types import SimpleNamespace

from prometheus_client import generate_latest

from pdserve.router.generation import Result
from pdserve.router.metrics import RouterMetrics


class _NoWorkers:
    def workers(self, pool, routable=True):
        return []


def _finished(ttft_s: float, tpot_s: float | None, tokens: int, finish: str = "length"):
    result = Result(num_completion_tokens=tokens, finish_reason=finish, first_token_at=100.0 + ttft_s)
    end = result.first_token_at + (tpot_s or 0) * (tokens - 1)
    return SimpleNamespace(started=100.0, prompt_ids=[1, 2, 3], result=result), end


def _sample(metrics: RouterMetrics, name: str) -> float | None:
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def test_goodput_counts_the_requests_that_met_both_slos():
    metrics = RouterMetrics(_NoWorkers(), ttft_slo_s=1.0, tpot_slo_s=0.1)
    for ttft, tpot, tokens, finish in [(0.5, 0.05, 10, "length"),  # met
                                       (0.9, None, 1, "stop"),     # met (no TPOT with one token)
                                       (1.5, 0.05, 10, "length"),  # TTFT missed
                                       (0.5, 0.2, 10, "stop"),     # TPOT missed
                                       (0.5, 0.05, 10, "abort")]:  # not finished
        generation, end = _finished(ttft, tpot, tokens, finish)
        metrics.observe(generation, end)
    assert _sample(metrics, "pdserve_goodput_requests_total") == 2
    assert _sample(metrics, "pdserve_slo_ttft_seconds") == 1.0 and _sample(metrics, "pdserve_slo_tpot_seconds") == 0.1


def test_without_slos_there_is_no_goodput_series():
    metrics = RouterMetrics(_NoWorkers())
    generation, end = _finished(0.1, 0.01, 5)
    metrics.observe(generation, end)
    assert _sample(metrics, "pdserve_goodput_requests_total") is None
