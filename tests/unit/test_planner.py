"""The planner's pure parts: latency fits, the simulator against closed forms, plans,
monotonicity, infeasible SLOs, malformed inputs, and the autoscaler's decisions."""

import json
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.cluster.autoscaler import Autoscaler
from pdserve.cluster.planner.search import SLO, make_plan, phase_curve
from pdserve.cluster.planner.simulator import attainment, simulate
from pdserve.cluster.planner.workload import SimRequest, load_trace, poisson
from pdserve.engine.profile import Profile, fit_colocated, fit_decode, fit_prefill

# A plausible one-core profile: ~2.5 ms per prompt token, decode steps of 30 ms + 1.5 ms/request
PROFILE = Profile("test", (0.02, 0.0025, 1e-8), (0.03, 0.0015, 2e-6), 46080, 1.5e9,
                  max_num_batched_tokens=2048, max_num_seqs=256)
LENGTHS = [(64, 32), (256, 64), (512, 128), (128, 16)]


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_single_prefill_server_matches_md1(rho):
    service = 0.1  # deterministic: one 100-token prompt per step, fixed step time
    profile = Profile("md1", (service, 0.0, 0.0), (0.01, 0.0, 0.0), 0, 1e12, max_num_batched_tokens=100)
    work = poisson(rho / service, 20000, [(100, 1)], seed=3)
    result = simulate(profile, work, prefill=1, decode=1)
    mean_ttft = sum(result.ttft_s) / len(result.ttft_s)
    expected = service + rho * service / (2 * (1 - rho))  # M/D/1: W = D + rho D / (2 (1 - rho))
    assert abs(mean_ttft - expected) / expected < 0.05


@pytest.mark.parametrize(("budget", "ttft"), [(512, 0.1 + 0.3 + 0.3), (100, 3 * (0.1 + 0.1) + 0.3)],
                         ids=["one-chunk", "three-chunks"])
def test_one_request_costs_exactly_its_steps(budget, ttft):
    """Closed form, worked by hand: prefill steps cost 0.1 s + 1 ms/token; 300 tokens x
    1000 B over 1 MB/s take 0.3 s to move; decode steps cost 10 ms + 2 ms/request +
    10 us/context token, so 4 tokens at contexts 301..304 average 12 ms + 3.025 ms."""
    profile = Profile("hand", (0.1, 0.001, 0.0), (0.01, 0.002, 1e-5), 1000, 1e6, max_num_batched_tokens=budget)
    result = simulate(profile, [SimRequest(0.0, 300, 5)], prefill=1, decode=1)
    assert result.ttft_s == [pytest.approx(ttft)]
    assert result.tpot_s == [pytest.approx(0.015025)]


def test_attainment_counts_failed_requests_as_misses_and_one_token_ones_by_ttft():
    latencies = [(0.5, 0.01), (0.5, 0.03), (2.0, 0.01), (None, None), (0.5, None)]
    assert attainment(latencies, 1.0, 0.02) == pytest.approx(2 / 5)  # the 1st and the one-token 5th
    assert attainment(latencies, 3.0, 0.05) == pytest.approx(4 / 5)  # all but the failed one
    assert attainment([], 1.0, 0.02) == 1.0


def test_simulated_requests_pair_each_ttft_with_its_own_tpot():
    """Two requests, one of a single token: requests() carries each one's (TTFT, TPOT), and
    attainment over it is the simulator's own."""
    profile = Profile("hand", (0.1, 0.001, 0.0), (0.01, 0.002, 1e-5), 1000, 1e6, max_num_batched_tokens=512)
    result = simulate(profile, [SimRequest(0.0, 300, 1), SimRequest(5.0, 300, 5)], prefill=1, decode=1)
    assert result.requests() == [(pytest.approx(0.7), None), (pytest.approx(0.7), pytest.approx(0.015025))]
    assert result.attainment(0.8, 0.015) == attainment(result.requests(), 0.8, 0.015) == 0.5


def test_simulated_requests_come_back_in_the_order_given():
    """A long request that arrives first finishes after a short one that arrives later:
    requests() still lists the long one first, so it pairs with a load generator's results.
    By hand: a 300-token prefill takes 0.4 s and its KV 0.3 s to ship, so the first arrival's
    TTFT is 0.7 s; the second (at 0.2 s) waits for the prefill worker until 0.4 s: 0.9 s."""
    profile = Profile("hand", (0.1, 0.001, 0.0), (0.01, 0.002, 1e-5), 1000, 1e6, max_num_batched_tokens=512)
    long, short = SimRequest(0.0, 300, 200), SimRequest(0.2, 300, 2)
    result = simulate(profile, [long, short], prefill=1, decode=1)
    long_alone = simulate(profile, [long], prefill=1, decode=1).requests()[0]
    (long_ttft, long_tpot), (short_ttft, short_tpot) = result.requests()
    assert (long_ttft, short_ttft) == (pytest.approx(0.7), pytest.approx(0.9))
    assert long_tpot == pytest.approx(long_alone[1], rel=0.02)  # 199 steps, two of them beside the short one
    assert short_tpot < 0.035  # one token after its first, within two decode steps


def test_long_prompts_stall_colocated_decoding():
    work = poisson(0.5, 200, [(1800, 64), (64, 128)], seed=1)
    disagg = simulate(PROFILE, work, prefill=1, decode=1)
    colocated = simulate(PROFILE, work, prefill=0, decode=2, colocated=True)
    assert colocated.percentile("tpot_s", 90) > 2 * disagg.percentile("tpot_s", 90)


def test_the_decode_fit_minimises_relative_error_so_small_steps_count_as_much_as_large_ones():
    """The largest profiled step (64 rows) measured 10% long: fitted by relative error, the
    one-row steps' predictions move under 0.5%; by absolute least squares, the largest step
    sets the fit and they move about twice as far, over 0.8%."""
    from pdserve.cluster.planner.profiler import DECODE_SHAPES
    from pdserve.engine.profile import fit_nonnegative

    def truth(b, c):
        return 0.03 + 0.0005 * b + 3e-6 * c + 1e-5 * b * b

    samples = [(b, b * x, truth(b, b * x) * (1.1 if b == 64 else 1.0)) for b, x in DECODE_SHAPES]
    data = np.asarray(samples)
    features = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1], data[:, 0] ** 2])
    for fitted, (low, high) in ((fit_decode(samples), (0.0, 0.005)), (fit_nonnegative(features, data[:, 2]),
                                                                     (0.008, 1.0))):
        for c in (64, 2048):
            error = abs(float(np.dot(fitted, (1, 1, c, 1))) / truth(1, c) - 1)
            assert low < error < high


def test_fits_recover_known_coefficients():
    prefill = [(t, q, 0.01 + 0.002 * t + 3e-7 * q) for t, q in [(32, 1024), (256, 65536), (1024, 2**20),
                                                               (1024, 2**18), (2048, 2**22)]]
    shapes = [(1, 128), (4, 2048), (16, 2048), (64, 32768), (8, 512)]
    decode = [(b, c, 0.02 + 0.001 * b + 1e-6 * c) for b, c in shapes]
    assert fit_prefill(prefill) == pytest.approx((0.01, 0.002, 3e-7), rel=1e-6)
    assert fit_decode(decode) == pytest.approx((0.02, 0.001, 1e-6, 0.0), rel=1e-6, abs=1e-12)
    # with a B^2 term (a step's cost growing faster than its rows)
    decode = [(b, c, 0.02 + 0.001 * b + 1e-6 * c + 2e-5 * b * b) for b, c in shapes]
    assert fit_decode(decode) == pytest.approx((0.02, 0.001, 1e-6, 2e-5), rel=1e-6)
    # c5 (T^2: a step outgrowing the caches) and c6 (a step carrying both prompt and decode rows)
    true = (0.015, 0.0021, 2.5e-7, 0.0013, 2e-6, 4e-8, 0.02)

    def mixed_time(t, q, b, c):
        return (true[0] + true[1] * t + true[2] * q + true[3] * b + true[4] * c + true[5] * t * t
                + true[6] * (t > 0 and b > 0))

    mixed = [(t, q, b, c, mixed_time(t, q, b, c)) for t, q, b, c in [(128, 16384, 4, 512), (512, 2**18, 16, 2048),
                                                                      (1536, 1536**2, 64, 8192)]]
    prefill = [(t, q, mixed_time(t, q, 0, 0)) for t, q, _ in prefill]
    decode = [(b, c, mixed_time(0, 0, b, c)) for b, c, _ in decode]
    assert fit_colocated(prefill, decode, mixed) == pytest.approx(true, rel=1e-6)


def test_a_profile_with_a_mixed_step_model_uses_it_and_scales_it(tmp_path):
    slow_mixing = Profile("m", (0.01, 0.001, 0.0), (0.01, 0.002, 0.0), 1000, 1e9,
                          colocated_coeffs=(0.05, 0.003, 0.0, 0.004, 0.0))
    assert slow_mixing.colocated_step_s(100, 10000, 10, 1000) == pytest.approx(0.05 + 0.3 + 0.04)
    additive = Profile("m", (0.01, 0.001, 0.0), (0.01, 0.002, 0.0), 1000, 1e9)
    assert additive.colocated_step_s(100, 10000, 10, 1000) == pytest.approx(0.01 + 0.1 + 0.02)
    scaled = slow_mixing.scaled(prefill=2.0, decode=3.0)
    assert scaled.colocated_coeffs == pytest.approx((0.15, 0.006, 0.0, 0.012, 0.0))
    path = tmp_path / "p.json"
    path.write_text(slow_mixing.to_json())
    assert Profile.load(path) == slow_mixing
    work = poisson(0.5, 100, [(1024, 64), (64, 128)], seed=2)
    slower = simulate(slow_mixing, work, prefill=0, decode=1, colocated=True)
    faster = simulate(additive, work, prefill=0, decode=1, colocated=True)
    assert slower.percentile("tpot_s", 90) > 1.5 * faster.percentile("tpot_s", 90)
    with pytest.raises(ValueError, match="colocated_coeffs must be 5, 7 or 8 finite non-negative numbers"):
        Profile("m", (0, 0, 0), (0, 0, 0), 1, 1.0, colocated_coeffs=(1.0, 2.0))


def test_the_mixed_step_model_charges_a_steps_size_squared_and_carrying_both_kinds_of_rows():
    five = (0.05, 0.003, 1e-6, 0.004, 1e-5)
    old = Profile("m", (0.01, 0.001, 0.0), (0.01, 0.002, 0.0), 1000, 1e9, colocated_coeffs=five)
    new = Profile("m", (0.01, 0.001, 0.0), (0.01, 0.002, 0.0), 1000, 1e9, colocated_coeffs=(*five, 2e-8, 0.03))
    # a profile from before the two terms reads as it did
    assert old.colocated_step_s(512, 2**18, 8, 800) == pytest.approx(0.05 + 1.536 + 0.262144 + 0.032 + 0.008)
    # T^2 on every step with prompt tokens; the fixed extra only where prompt and decode rows meet
    assert new.colocated_step_s(512, 2**18, 8, 800) == pytest.approx(
        old.colocated_step_s(512, 2**18, 8, 800) + 2e-8 * 512**2 + 0.03)
    assert new.colocated_step_s(512, 2**18, 0, 0) == pytest.approx(old.colocated_step_s(512, 2**18, 0, 0)
                                                                     + 2e-8 * 512**2)
    assert new.colocated_step_s(0, 0, 8, 800) == pytest.approx(old.colocated_step_s(0, 0, 8, 800))
    # scaling: T^2 is a prefill term, the mixed extra takes the larger factor, like c0
    assert new.scaled(prefill=2.0, decode=3.0).colocated_coeffs == pytest.approx(
        (0.15, 0.006, 2e-6, 0.012, 3e-5, 4e-8, 0.09))
    assert old.scaled(prefill=2.0, decode=3.0).colocated_coeffs == pytest.approx((0.15, 0.006, 2e-6, 0.012, 3e-5))


@pytest.fixture(scope="module")
def curves():
    return {phase: phase_curve(PROFILE, LENGTHS, phase) for phase in ("prefill", "decode", "colocated")}


def test_plan_sizes_each_pool_for_its_own_slo(curves):
    work = poisson(1.0, 200, LENGTHS, seed=0)
    base = make_plan(PROFILE, SLO(2.0, 0.15), 6.0, work, curves)
    tighter_tpot = make_plan(PROFILE, SLO(2.0, 0.06), 6.0, work, curves)
    tighter_ttft = make_plan(PROFILE, SLO(1.5, 0.15), 6.0, work, curves)
    # a TPOT SLO sizes only the decode pool, a TTFT SLO only the prefill pool
    assert tighter_tpot.prefill == base.prefill and tighter_tpot.decode > base.decode
    assert tighter_ttft.decode == base.decode and tighter_ttft.prefill > base.prefill
    for plan in (base, tighter_tpot, tighter_ttft):
        assert plan.feasible
        # the whole system, simulated at the target rate with the planned counts, meets its SLOs
        predicted = plan.predicted["disaggregated"]
        assert predicted["attainment"] > 0.9
        assert predicted["ttft_p"] <= plan.slo.ttft_s and predicted["tpot_p"] <= plan.slo.tpot_s
    assert "disaggregated" in base.table() and "colocated" in base.table()


@settings(max_examples=20, deadline=None)
@given(rate=st.floats(0.1, 6.0), factor=st.floats(1.0, 3.0), ttft=st.floats(0.5, 5.0), tpot=st.floats(0.05, 0.5),
       tighten=st.floats(0.3, 1.0))
def test_higher_rate_or_tighter_slo_never_needs_fewer_instances(curves, rate, factor, ttft, tpot, tighten):
    work = poisson(1.0, 50, LENGTHS, seed=0)
    base = make_plan(PROFILE, SLO(ttft, tpot), rate, work, curves, verify_requests=50)
    busier = make_plan(PROFILE, SLO(ttft, tpot), rate * factor, work, curves, verify_requests=50)
    tighter = make_plan(PROFILE, SLO(ttft * tighten, tpot * tighten), rate, work, curves, verify_requests=50)
    assert busier.feasible == base.feasible  # feasibility depends on the SLO, not the rate
    assert base.feasible or not tighter.feasible  # tightening never makes an impossible SLO possible
    for plan in (busier, tighter):
        if plan.feasible:  # an infeasible plan says so instead of naming a count
            assert plan.prefill >= base.prefill and plan.decode >= base.decode
            assert plan.colocated >= base.colocated


def test_impossible_slos_get_a_plan_that_says_so(curves):
    work = poisson(1.0, 100, LENGTHS, seed=0)
    plan = make_plan(PROFILE, SLO(0.001, 0.001), 1.0, work, curves)
    assert not plan.feasible
    assert "no configuration meets these SLOs" in plan.note and "TTFT p90" in plan.note
    assert plan.predicted["disaggregated"]["attainment"] < 0.5


def test_malformed_profile_and_trace_are_named(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        Profile.load(bad)
    bad.write_text(json.dumps({"model": "m", "prefill_coeffs": [1, 2], "decode_coeffs": [0, 0, 0],
                               "kv_bytes_per_token": 1, "kv_bandwidth_bytes_per_s": 1.0}))
    with pytest.raises(ValueError, match="prefill_coeffs must be 3 or 4 finite non-negative numbers"):
        Profile.load(bad)
    bad.write_text(json.dumps({"model": "m"}))
    with pytest.raises(ValueError, match="missing"):
        Profile.load(bad)
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_s": 0, "prompt_len": 5, "max_tokens": 3}\n{"arrival_s": "soon"}\n')
    with pytest.raises(ValueError, match="line 2"):
        load_trace(trace)


def test_autoscaler_scales_decode_up_on_slow_tpot_and_down_after_cooldown():
    now = [0.0]
    scaler = Autoscaler(PROFILE, SLO(2.0, 0.05), {"prefill": (1, 4), "decode": (1, 4)}, cooldown_s=30,
                        clock=lambda: now[0])
    lengths = [(128, 64)] * 50
    busy = {"count": 50, "rate": 2.0, "lengths": lengths, "ttft_p": 0.5, "tpot_p": 0.2}
    decision = scaler.decide(busy, {"prefill": 1, "decode": 1})
    assert decision.action.get("decode", 1) > 1, decision
    assert decision.correction["decode"] > 1  # slower than the profile predicts
    now[0] = 10.0  # still cooling down: no second change
    assert "decode" not in scaler.decide(busy, {"prefill": 1, "decode": decision.action["decode"]}).action
    idle = {"count": 0, "rate": 0.0, "lengths": [], "ttft_p": None, "tpot_p": None}
    now[0] = 40.0
    assert scaler.decide(idle, {"prefill": 1, "decode": 3}).action == {}  # below plan: wait a cooldown
    now[0] = 75.0
    assert scaler.decide(idle, {"prefill": 1, "decode": 3}).action == {"decode": 1}


def test_the_correction_compares_the_window_as_it_arrived():
    # a burst of long prompts at once, then a trickle of short ones; the observed percentiles
    # are the profile's own on that window, so the engines run exactly as profiled
    window = ([SimRequest(0.0, 1024, 32) for _ in range(12)]
              + [SimRequest(60.0 + 2 * i, 128, 32) for i in range(12)])
    truth = simulate(PROFILE, window, 1, 1)
    observed = {"count": len(window), "rate": len(window) / 84.0,
                "lengths": [(r.prompt_len, r.output_len, 0) for r in window], "arrivals": [r.arrival_s for r in window],
                "ttft_p": truth.percentile("ttft_s", 90), "tpot_p": truth.percentile("tpot_s", 90)}
    bounds = {"prefill": (1, 8), "decode": (1, 8)}
    scaler = Autoscaler(PROFILE, SLO(2.0, 0.05), bounds, cooldown_s=0)
    scaler.decide(observed, {"prefill": 1, "decode": 1})
    assert scaler.correction == pytest.approx({"prefill": 1.0, "decode": 1.0})
    # without the arrival times the window is read as a Poisson stream at its rate, which
    # smooths the burst away: the burst's queueing is taken for slow prefill
    blind = Autoscaler(PROFILE, SLO(2.0, 0.05), bounds, cooldown_s=0)
    blind.decide({k: v for k, v in observed.items() if k != "arrivals"}, {"prefill": 1, "decode": 1})
    assert blind.correction["prefill"] > 1.5


def test_autoscaler_leaves_an_overridden_pool_alone():
    scaler = Autoscaler(PROFILE, SLO(2.0, 0.05), {"prefill": (1, 4), "decode": (1, 4)}, cooldown_s=0)
    busy = {"count": 50, "rate": 2.0, "lengths": [(128, 64)] * 50, "ttft_p": 0.5, "tpot_p": 0.2}
    decision = scaler.decide(busy, {"prefill": 1, "decode": 1}, overridden={"decode"})
    assert "decode" not in decision.action and "operator override" in decision.reason


def test_a_colocated_engine_takes_each_steps_own_model():
    # the mixed-step model is far off for pure steps here: a pure decode costs 0.01 + 0.002 B,
    # a pure prefill 0.01 + 0.001 T, but the mixed model puts 0.5 s on every step
    profile = Profile("m", (0.01, 0.001, 0.0), (0.01, 0.002, 0.0), 1000, 1e9,
                      colocated_coeffs=(0.5, 0.001, 0.0, 0.002, 0.0))
    assert profile.step_s(0, 0, 4, 400) == pytest.approx(0.018)
    assert profile.step_s(100, 10000, 0, 0) == pytest.approx(0.11)
    assert profile.step_s(100, 10000, 4, 400) == pytest.approx(0.5 + 0.1 + 0.008)
    # one request alone: its prompt in one prefill step, then 4 decode steps of batch 1
    result = simulate(profile, [SimRequest(0.0, 100, 5)], prefill=0, decode=1, colocated=True)
    assert result.ttft_s == [pytest.approx(0.11)]
    assert result.tpot_s == [pytest.approx(0.012)]
    # a second prompt arriving while the first decodes joins it in mixed steps, which alone pay 0.5 s
    pair = simulate(profile, [SimRequest(0.0, 100, 5), SimRequest(0.115, 100, 2)], prefill=0, decode=1,
                    colocated=True)
    assert max(pair.ttft_s) == pytest.approx(0.11 + 0.012 + 0.5 + 0.1 + 0.002 - 0.115)


def test_prefill_seconds_chunks_under_the_budget_and_mixing_costs_more():
    from pdserve.engine.profile import prefill_seconds

    profile = Profile("m", (0.01, 0.001, 0.0), (0.005, 0.0005, 0.00001), 1000, 1e9, max_num_batched_tokens=100)
    # closed form: 250 tokens = chunks of 100, 100, 50, each p0 + p1 * chunk
    assert prefill_seconds(profile, 250) == pytest.approx(3 * 0.01 + 0.001 * 250)
    assert prefill_seconds(profile, 0) == 0
    alone, mixed = prefill_seconds(profile, 250), prefill_seconds(profile, 250, batch=8, context=4000)
    assert mixed == pytest.approx(alone + 3 * (0.0005 * 8 + 0.00001 * 4000))


def test_a_cached_prefix_is_neither_computed_nor_shipped():
    """Closed form, as in test_one_request_costs_exactly_its_steps: of a 300-token prompt
    with 256 tokens cached, the prefill step computes 44 tokens (0.1 + 0.044 s) and ships
    44 x 1000 B at 1 MB/s (0.044 s)."""
    profile = Profile("hand", (0.1, 0.001, 0.0), (0.01, 0.002, 1e-5), 1000, 1e6, max_num_batched_tokens=512)
    result = simulate(profile, [SimRequest(0.0, 300, 5, cached_len=256)], prefill=1, decode=1)
    assert result.ttft_s == [pytest.approx(0.1 + 0.044 + 0.044)]


def test_attention_over_kv_already_in_the_cache_costs_the_k_term():
    """Closed forms with p3 = c7 = 1e-6 s per unit of K (new tokens x the context before
    them): 44 tokens over a 256-token cached prefix (K = 44 x 256) on a prefill instance and,
    locally, on the decode instance; and a 250-token prompt in chunks of 100 (K = 100 x 100
    + 50 x 200)."""
    from pdserve.engine.profile import prefill_seconds

    profile = Profile("hand", (0.1, 0.001, 0.0, 1e-6), (0.01, 0.002, 1e-5), 1000, 1e6, max_num_batched_tokens=512,
                      colocated_coeffs=(0.1, 0.001, 0.0, 0.002, 1e-5, 0.0, 0.0, 1e-6))
    request = [SimRequest(0.0, 300, 5, cached_len=256)]
    assert simulate(profile, request, 1, 1).ttft_s == [pytest.approx(0.1 + 0.044 + 44 * 256e-6 + 0.044)]
    assert simulate(profile, request, 1, 1, local_prefill_max_tokens=64).ttft_s == [
        pytest.approx(0.1 + 0.044 + 44 * 256e-6)]
    fresh = replace(profile, prefill_coeffs=(0.1, 0.001, 0.0), colocated_coeffs=profile.colocated_coeffs[:7])
    assert simulate(fresh, request, 1, 1).ttft_s == [pytest.approx(0.1 + 0.044 + 0.044)]
    chunked = replace(profile, max_num_batched_tokens=100)
    assert prefill_seconds(chunked, 250) == pytest.approx(3 * 0.1 + 0.25 + (100 * 100 + 50 * 200) * 1e-6)
    # a step log's K is priced the same way by calibration
    from pdserve.cluster.planner.calibrate import predicted_s

    assert predicted_s(profile, {"T": 44, "Q": 44 * 300, "K": 44 * 256, "B": 0, "C": 0}) == pytest.approx(
        0.1 + 0.044 + 44 * 256e-6)
    assert predicted_s(profile, {"T": 44, "Q": 44 * 300, "B": 0, "C": 0}) == pytest.approx(0.144)  # logged before K


def test_the_k_terms_are_fitted_on_steps_over_a_cached_prefix():
    """Steps over a cached prefix that took the fresh model plus 2e-6 s (prefill) and 3e-6 s
    (mixed) per unit of K: the profiler's fit recovers both terms and leaves the rest."""
    from pdserve.cluster.planner.profiler import with_cached_attention

    fresh = Profile("m", (0.02, 0.001, 1e-7), (0.03, 0.002, 1e-6), 1000, 1e9,
                    colocated_coeffs=(0.03, 0.001, 1e-7, 0.002, 1e-6, 0.0, 0.01))
    samples = []
    for t, b, cached in ((64, 0, 512), (256, 0, 1536), (1024, 0, 512), (64, 4, 1536), (256, 16, 512)):
        q, k, c = t * (cached + t), t * cached, b * 129
        s = (fresh.colocated_step_s(t, q, b, c) + 3e-6 * k) if b else fresh.prefill_step_s(t, q) + 2e-6 * k
        samples.append((t, q, b, c, k, s))
    fitted = with_cached_attention(fresh, samples)
    assert fitted.prefill_coeffs == pytest.approx((*fresh.prefill_coeffs, 2e-6))
    assert fitted.colocated_coeffs == pytest.approx((*fresh.colocated_coeffs, 3e-6))
    assert with_cached_attention(fresh, []) == fresh


def test_a_short_uncached_tail_is_prefilled_on_the_decode_instance():
    """44 uncached tokens <= local_prefill_max_tokens: one mixed step on the decode instance
    (max(0.1, 0.01) + 0.044 s), no prefill instance and no transfer."""
    profile = Profile("hand", (0.1, 0.001, 0.0), (0.01, 0.002, 1e-5), 1000, 1e6, max_num_batched_tokens=512)
    request = [SimRequest(0.0, 300, 5, cached_len=256)]
    assert simulate(profile, request, 1, 1, local_prefill_max_tokens=64).ttft_s == [pytest.approx(0.1 + 0.044)]
    assert simulate(profile, request, 1, 1, local_prefill_max_tokens=43).ttft_s == [pytest.approx(0.188)]


def test_prefix_hits_raise_what_one_prefill_instance_sustains():
    from pdserve.cluster.planner.workload import with_hit_rate

    slo = SLO(8.0, 0.2)  # one 2048-token prompt alone takes ~5 s here
    work = poisson(1.0, 50, [(1024, 16), (2048, 16)], seed=5)
    capacity = [phase_curve(PROFILE, [(r.prompt_len, r.output_len, r.cached_len) for r in with_hit_rate(work, h)],
                            "prefill", requests=150).capacity(slo, True, False) for h in (0.0, 0.5, 0.9)]
    assert capacity[0] < capacity[1] < capacity[2]


def test_hit_rates_given_and_measured():
    from pdserve.cluster.planner.workload import hit_rate, with_hit_rate

    requests = [SimRequest(0, 100, 1), SimRequest(1, 17, 1), SimRequest(2, 16, 1)]
    # whole 16-token blocks, never the last token
    assert [r.cached_len for r in with_hit_rate(requests, 0.5)] == [48, 0, 0]
    assert [r.cached_len for r in with_hit_rate(requests, 1.0)] == [96, 16, 0]
    with pytest.raises(ValueError, match="hit rate must be in"):
        with_hit_rate(requests, 1.5)
    assert hit_rate(with_hit_rate(requests, 1.0)) == pytest.approx(112 / 133)


def test_a_trace_with_token_ids_measures_its_own_reuse(tmp_path):
    shared = list(range(100, 164))  # 4 blocks
    rows = [{"arrival_s": 1.0, "prompt_token_ids": shared + [7, 8, 9], "max_tokens": 4},
            {"arrival_s": 0.0, "prompt_token_ids": shared + [1, 2], "max_tokens": 4},  # arrives first
            {"arrival_s": 2.0, "prompt_len": 50, "max_tokens": 4}]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert [r.cached_len for r in load_trace(path)] == [0, 64, 0]


def test_the_autoscaler_wants_fewer_prefill_workers_when_prompts_hit_the_cache():
    slo = SLO(1.0, 0.2)
    bounds = {"prefill": (1, 64), "decode": (1, 64)}
    plain = {"count": 50, "rate": 3.0, "lengths": [(2048, 16, 0)] * 50, "ttft_p": None, "tpot_p": None}
    cached = {**plain, "lengths": [(2048, 16, 1920)] * 50}
    want = [Autoscaler(PROFILE, slo, bounds, cooldown_s=0, local_prefill_max_tokens=0).decide(
        observed, {"prefill": 1, "decode": 1}).desired["prefill"] for observed in (plain, cached)]
    assert want[1] < want[0]


def test_calibration_recovers_how_much_slower_serving_steps_are():
    from pdserve.cluster.planner.calibrate import MIN_STEPS, calibrate

    profile = Profile("m", (0.02, 0.001, 1e-7), (0.03, 0.002, 1e-6), 1000, 1e9,
                      colocated_coeffs=(0.03, 0.001, 1e-7, 0.002, 1e-6))
    serving = profile.scaled(prefill=1.3, decode=1.1, mixed=1.6)  # what the steps really took
    shapes = ([(t, t * t, 0, 0) for t in (64, 256, 1024, 2048, 512, 128)]
              + [(0, 0, b, b * 300) for b in (1, 4, 16, 64, 32, 8)]
              + [(t, t * t, b, b * 200) for t, b in ((128, 4), (512, 16), (64, 64), (256, 8), (1024, 2))]
              + [(t, t * t, 0, 0) for t in (32,)])
    steps = [{"T": t, "Q": q, "B": b, "C": c, "s": (serving.colocated_step_s(t, q, b, c) if t and b else
                                                    serving.prefill_step_s(t, q) if t else serving.decode_step_s(b, c))}
             for t, q, b, c in shapes]
    calibrated = calibrate(profile, steps)
    assert calibrated.samples["serving_calibration"]["factors"] == pytest.approx(
        {"prefill": 1.3, "decode": 1.1, "mixed": 1.6})
    for t, q, b, c in shapes:
        assert calibrated.colocated_step_s(t, q, b, c) == pytest.approx(serving.colocated_step_s(t, q, b, c))
        assert calibrated.prefill_step_s(t, q) == pytest.approx(serving.prefill_step_s(t, q))
        assert calibrated.decode_step_s(b, c) == pytest.approx(serving.decode_step_s(b, c))
    # too few mixed steps: their prefill terms take the prefill factor, their decode terms the decode one
    few = calibrate(profile, [s for s in steps if not (s["T"] and s["B"])] + [steps[12]] * (MIN_STEPS - 1))
    assert set(few.samples["serving_calibration"]["factors"]) == {"prefill", "decode"}
    assert few.colocated_coeffs == pytest.approx(profile.scaled(prefill=1.3, decode=1.1).colocated_coeffs)
    decode_only = calibrate(profile, [s for s in steps if not s["T"]])  # and unlogged prefill keeps its own
    assert decode_only.prefill_coeffs == profile.prefill_coeffs


def test_calibration_matches_the_steps_total_time_not_the_typical_step():
    """A TPOT is a sum of steps: the calibrated model must reproduce the steps' total even
    when a few of them (preempted, or the large ones) ran much slower than the rest."""
    from pdserve.cluster.planner.calibrate import calibrate

    profile = Profile("m", (0.02, 0.001, 1e-7), (0.03, 0.002, 1e-6), 1000, 1e9)
    shapes = [(b, b * 300) for b in (1, 2, 4, 8, 16, 32, 48, 64)] * 3
    slow = {5, 6, 7}  # three of the 24 steps ran 3x the model, the rest 1.1x
    steps = [{"T": 0, "Q": 0, "B": b, "C": c, "s": profile.decode_step_s(b, c) * (3.0 if i in slow else 1.1)}
             for i, (b, c) in enumerate(shapes)]
    calibrated = calibrate(profile, steps)
    assert sum(calibrated.decode_step_s(s["B"], s["C"]) for s in steps) == pytest.approx(sum(s["s"] for s in steps))
    record = calibrated.samples["serving_calibration"]
    assert record["median_ratios"]["decode"] == pytest.approx(1.1)  # the typical step, kept for the record
    assert record["factors"]["decode"] > 1.1


def test_prefill_rate_is_the_prompt_tokens_a_second_the_prefill_engines_computed_during_a_step():
    from pdserve.cluster.planner.calibrate import prefill_rate

    steps = [{"name": "prefill", "pid": 1, "t": 0.0, "s": 1.0, "T": 100},  # 100 tokens/s
             {"name": "prefill", "pid": 1, "t": 1.5, "s": 1.0, "T": 300},
             {"name": "prefill", "pid": 2, "t": 0.0, "s": 4.0, "T": 800},  # 200 tokens/s
             {"name": "decode", "pid": 3, "t": 0.5, "s": 1.0},  # engine 1: 100/s for half of it, engine 2: 200/s
             {"name": "decode", "pid": 3, "t": 5.0, "s": 1.0}]  # neither
    assert prefill_rate(steps)[3:] == pytest.approx([(0.5 * 100 + 200) / 2, 0.0])
    assert prefill_rate([{"name": "decode", "pid": 3, "t": 0.0, "s": 1.0}]) == [0.0]  # no prefill engine logged


def test_prefill_rate_of_a_pooled_log_averages_only_over_the_engines_alive_beside_the_step():
    """Two services one after another (a prefill engine each) pooled into one log: each
    decode step's rate is its own service's prefill engine's, not halved by the other's."""
    from pdserve.cluster.planner.calibrate import prefill_rate

    first = [{"name": "prefill", "pid": 1, "t": 0.0, "s": 2.0, "T": 600},  # 300 tokens/s
             {"name": "decode", "pid": 2, "t": 0.5, "s": 1.0}]
    second = [{"name": "prefill", "pid": 3, "t": 10.0, "s": 1.0, "T": 100},  # 100 tokens/s
              {"name": "prefill", "pid": 3, "t": 12.0, "s": 1.0, "T": 100},
              {"name": "decode", "pid": 4, "t": 11.0, "s": 1.0}]  # between its engine's steps: 0
    pooled = prefill_rate(first + second)
    assert pooled == pytest.approx([300.0, 300.0, 100.0, 100.0, 0.0])
    assert pooled[1] == prefill_rate(first)[1]


def _serving_decode_log(profile, factor: float, cotenancy: float) -> list[dict]:
    """A step log of one prefill engine and one decode engine whose decode steps took
    `factor` x the profile's decode model, plus `cotenancy` x the profiled step per prompt
    token a second the prefill engine computed during it."""
    steps, t = [], 0.0
    for i, batch in enumerate((1, 2, 3, 4, 8, 16, 32, 1, 2, 6, 12, 24) * 2):
        context = batch * 200
        model = profile.decode_step_s(batch, context)
        busy, own_rate = ((1.0, 1000.0), (0.0, 0.0), (0.5, 3000.0), (1.0, 400.0))[i % 4]
        seconds = factor * model + cotenancy * busy * own_rate * model
        if busy:  # the prefill engine computes from the decode step's start for `busy` of it
            steps.append({"name": "prefill", "pid": 1, "t": t, "s": busy * seconds, "T": own_rate * busy * seconds,
                          "Q": 4096, "B": 0, "C": 0})
        steps.append({"name": "decode", "pid": 2, "t": t, "s": seconds, "T": 0, "Q": 0, "B": batch, "C": context})
        t += seconds + 1.0
    return steps


def test_decode_calibration_fits_one_factor_and_co_tenancy():
    """Serving slowed every decode step 1.3x, and more while the prefill engine computed:
    calibration recovers the factor and the co-tenancy term, so predicts steps of any batch,
    busy or not, and keeps the steps' total."""
    from pdserve.cluster.planner.calibrate import calibrate

    profile = Profile("m", (0.02, 0.001, 1e-7), (0.03, 0.002, 1e-6), 1000, 1e9)
    steps = _serving_decode_log(profile, factor=1.3, cotenancy=2e-4)
    calibrated = calibrate(profile, steps)
    terms = calibrated.samples["serving_calibration"]["decode_terms"]
    assert terms == pytest.approx({"factor": 1.3, "prefill_rate": 2e-4})
    for batch, rate in ((1, 0.0), (1, 1000.0), (32, 0.0), (32, 3000.0), (5, 300.0), (64, 0.0)):
        context = batch * 200
        truth = (1.3 + 2e-4 * rate) * profile.decode_step_s(batch, context)
        assert calibrated.decode_step_s(batch, context, rate) == pytest.approx(truth)
    # the total ratio alone (1.3 and the co-tenancy folded in) over-predicts an idle step
    scalar = profile.scaled(decode=calibrated.samples["serving_calibration"]["factors"]["decode"])
    assert scalar.decode_step_s(8, 1600) > 1.05 * calibrated.decode_step_s(8, 1600)
    # the steps' total is kept
    assert sum(calibrated.decode_step_s(s["B"], s["C"], b) for s, b in zip(steps, _busy(steps), strict=True)
               if s["name"] == "decode") == pytest.approx(sum(s["s"] for s in steps if s["name"] == "decode"))


def _busy(steps):
    from pdserve.cluster.planner.calibrate import prefill_rate

    return prefill_rate(steps)


def test_decode_steps_with_no_prefill_engine_beside_them_take_one_factor():
    """A log with no prefill engine in it cannot tell co-tenancy from the steps' own speed:
    the whole decode model is scaled by the total's ratio, no terms, no co-tenancy."""
    from pdserve.cluster.planner.calibrate import calibrate

    profile = Profile("m", (0.02, 0.001, 1e-7), (0.03, 0.002, 1e-6), 1000, 1e9)
    steps = [{"T": 0, "Q": 0, "B": 8, "C": 1600, "s": 1.3 * profile.decode_step_s(8, 1600)}] * 10
    calibrated = calibrate(profile, steps)
    assert "decode_terms" not in calibrated.samples["serving_calibration"]
    assert calibrated.decode_coeffs == pytest.approx(tuple(1.3 * c for c in profile.decode_coeffs))
    assert calibrated.decode_cotenancy_coeffs == (0.0, 0.0, 0.0)


def test_co_tenancy_slows_the_decode_steps_that_run_beside_a_prefill_and_no_others(tmp_path):
    profile = Profile("hand", (0.1, 0.001, 0.0), (0.01, 0.002, 1e-5), 1000, 1e6)
    # steps twice as long beside a prefill of 1,000 tokens a second
    shared = replace(profile, decode_cotenancy_coeffs=(1e-5, 2e-6, 1e-8))
    alone = [SimRequest(0.0, 300, 20)]
    assert simulate(shared, alone, 1, 1).tpot_s == pytest.approx(simulate(profile, alone, 1, 1).tpot_s)
    beside = [SimRequest(0.0, 300, 40), SimRequest(0.5, 2000, 2)]  # a long prompt while the first decodes
    slow, plain = simulate(shared, beside, 1, 1), simulate(profile, beside, 1, 1)
    assert slow.tpot_s[0] > plain.tpot_s[0] * 1.05
    assert slow.ttft_s == pytest.approx(plain.ttft_s)  # prefill steps are not slowed
    colocated = [simulate(p, beside, 0, 1, colocated=True).tpot_s for p in (shared, profile)]
    assert colocated[0] == pytest.approx(colocated[1])  # no prefill instance beside a colocated engine
    # it is saved, loaded and scaled with the decode model
    path = tmp_path / "p.json"
    path.write_text(shared.to_json())
    assert Profile.load(path).decode_cotenancy_coeffs == shared.decode_cotenancy_coeffs
    assert shared.scaled(decode=2.0).decode_cotenancy_coeffs == pytest.approx((2e-5, 4e-6, 2e-8))


def test_mixed_steps_take_the_decode_steps_co_tenancy_and_a_factor_of_their_own():
    """A log whose decode steps carry co-tenancy 2e-4 of the step per prefill token a second,
    and whose mixed steps (a decode worker's local prefills) took 1.2x the profile's mixed
    model plus the same co-tenancy: calibration fits m = 1.2 on the mixed steps with the
    decode's k, so a mixed step beside no prefill is predicted at 1.2x, beside one at the
    truth -- where one factor over the mixed steps, all logged beside a prefill, would carry
    that co-tenancy to every mixed step."""
    from pdserve.cluster.planner.calibrate import calibrate

    profile = Profile("m", (0.02, 0.001, 1e-7), (0.03, 0.002, 1e-6), 1000, 1e9,
                      colocated_coeffs=(0.03, 0.001, 1e-7, 0.002, 1e-6, 0.0, 0.01))
    steps = _serving_decode_log(profile, factor=1.3, cotenancy=2e-4)
    t = steps[-1]["t"] + 10.0
    for i, (tokens, batch) in enumerate(((64, 4), (128, 8), (200, 2), (32, 12), (96, 6), (150, 3)) * 2):
        model = profile.colocated_step_s(tokens, tokens * tokens, batch, batch * 200)
        own_rate = (800.0, 1500.0)[i % 2]  # a prefill step covering the mixed step
        seconds = 1.2 * model + 2e-4 * own_rate * model
        steps.append({"name": "prefill", "pid": 1, "t": t, "s": seconds, "T": own_rate * seconds, "Q": 0, "B": 0,
                      "C": 0})
        steps.append({"name": "decode", "pid": 2, "t": t, "s": seconds, "T": tokens, "Q": tokens * tokens,
                      "B": batch, "C": batch * 200})
        t += seconds + 1.0
    calibrated = calibrate(profile, steps)
    record = calibrated.samples["serving_calibration"]
    assert record["mixed_terms"] == pytest.approx({"step": 1.2, "prefill_rate": 2e-4})
    model = profile.colocated_step_s(100, 10000, 5, 1000)
    assert calibrated.colocated_step_s(100, 10000, 5, 1000) == pytest.approx(1.2 * model)
    assert calibrated.colocated_step_s(100, 10000, 5, 1000, prefill_rate=1000.0) == pytest.approx(1.4 * model)
    assert record["factors"]["mixed"] > 1.3  # one factor would have put the idle step there
    # the simulator slows a local prefill beside a computing prefill instance, and no other
    # (a short prompt prefilled locally beside a running decode; a long one on the prefill instance)
    quiet = [SimRequest(0.0, 64, 200), SimRequest(0.1, 100, 4)]
    beside = [SimRequest(0.0, 64, 200), SimRequest(0.01, 1500, 2), SimRequest(0.1, 100, 4)]
    plain = replace(calibrated, mixed_cotenancy=0.0)
    assert (simulate(calibrated, quiet, 1, 1, local_prefill_max_tokens=256).ttft_s
            == pytest.approx(simulate(plain, quiet, 1, 1, local_prefill_max_tokens=256).ttft_s))
    assert (simulate(calibrated, beside, 1, 1, local_prefill_max_tokens=256).ttft_s[2]
            > 1.05 * simulate(plain, beside, 1, 1, local_prefill_max_tokens=256).ttft_s[2])


def _colocated_log(profile, exponent: float, tokens: tuple[int, ...]) -> list[dict]:
    """A colocated engine's step log whose mixed steps (prompt chunks of `tokens` beside 4
    decodes) took 1.5 x M ** (1 - exponent) seconds, M the profile's mixed model in seconds:
    small steps slowed more than large ones."""
    steps = []
    for i, chunk in enumerate(tokens):
        model = profile.colocated_step_s(chunk, chunk * chunk, 4, 800)
        steps.append({"name": "colocated", "pid": 1, "t": 10.0 * i, "s": 1.5 * model ** (1 - exponent),
                      "T": chunk, "Q": chunk * chunk, "B": 4, "C": 800})
    return steps


def test_mixed_steps_slowed_more_when_small_fit_a_size_exponent_that_predicts_other_sizes():
    """Serving slowed a colocated engine's mixed steps as 1.5 x M ** 0.85 (exponent 0.15):
    calibrated on steps of 0.1-1 s, the model predicts steps of 0.03 s and of 6 s, outside
    that range, within 1%, where one factor over the same steps misses both by over 15%."""
    from pdserve.cluster.planner.calibrate import MIN_SIZE_SPREAD, calibrate

    profile = Profile("m", (0.02, 0.001, 1e-7), (0.03, 0.002, 1e-6), 1000, 1e9,
                      colocated_coeffs=(0.03, 0.001, 1e-7, 0.002, 1e-6, 0.0, 0.01))
    steps = _colocated_log(profile, 0.15, (64, 128, 256, 384, 512, 640, 768, 896, 1024))
    calibrated = calibrate(profile, steps)
    record = calibrated.samples["serving_calibration"]
    assert record["mixed_size"]["exponent"] == pytest.approx(0.15)
    plain = profile.scaled(mixed=record["factors"]["mixed"])  # as calibration scaled without the exponent
    for chunk in (8, 2048):
        model = profile.colocated_step_s(chunk, chunk * chunk, 4, 800)
        truth = 1.5 * model ** 0.85
        assert calibrated.colocated_step_s(chunk, chunk * chunk, 4, 800) == pytest.approx(truth, rel=0.01)
        assert abs(plain.colocated_step_s(chunk, chunk * chunk, 4, 800) / truth - 1) > 0.15
    # scaling the calibrated profile scales its mixed steps by the factor, exponent and all
    assert calibrated.scaled(mixed=2.0).colocated_step_s(300, 90000, 4, 800) == pytest.approx(
        2.0 * calibrated.colocated_step_s(300, 90000, 4, 800))
    # decode, prefill-only and the mixed steps' total are untouched or kept
    assert calibrated.decode_step_s(8, 1600) == profile.decode_step_s(8, 1600)
    assert sum(calibrated.colocated_step_s(s["T"], s["Q"], s["B"], s["C"]) for s in steps) == pytest.approx(
        sum(s["s"] for s in steps), rel=0.01)
    # sizes spanning less than MIN_SIZE_SPREAD: no exponent, one factor
    narrow = [s for s in steps if s["T"] >= 512]
    sizes = [profile.colocated_step_s(s["T"], s["Q"], 4, 800) for s in narrow]
    assert max(sizes) < MIN_SIZE_SPREAD * min(sizes)
    assert "mixed_size" not in calibrate(profile, narrow).samples["serving_calibration"]
    # a serving log whose small steps are not the slower ones: no exponent
    for exponent in (0.0, -0.1):
        log = _colocated_log(profile, exponent, (64, 256, 512, 768, 1024))
        assert "mixed_size" not in calibrate(profile, log).samples["serving_calibration"]


def test_a_profiles_size_exponent_is_checked_and_saved(tmp_path):
    profile = Profile("m", (0.02, 0.001, 1e-7), (0.03, 0.002, 1e-6), 1000, 1e9, mixed_size_exponent=0.12,
                      mixed_reference_s=0.8)
    path = tmp_path / "p.json"
    path.write_text(profile.to_json())
    assert Profile.load(path) == profile
    for bad in ({"mixed_size_exponent": 1.0}, {"mixed_size_exponent": -0.1}, {"mixed_reference_s": 0.0},
                {"mixed_reference_s": float("inf")}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            replace(profile, **bad)


def test_speed_change_is_the_later_logs_slowdown_over_the_earlier_ones_kind_by_kind():
    from pdserve.cluster.planner.calibrate import MIN_STEPS, speed_change

    profile = Profile("m", (0.02, 0.001, 1e-7), (0.03, 0.002, 1e-6), 1000, 1e9)

    def log(prefill: float, decode: float, prefills: int = MIN_STEPS) -> list[dict]:
        return ([{"T": t, "Q": t * t, "B": 0, "C": 0, "s": prefill * profile.prefill_step_s(t, t * t)}
                 for t in (64, 128, 256, 512, 1024)[:prefills]]
                + [{"T": 0, "Q": 0, "B": b, "C": b * 100, "s": decode * profile.decode_step_s(b, b * 100)}
                   for b in (1, 2, 4, 8, 16, 32)])

    change = speed_change(profile, log(1.2, 0.8), log(1.8, 0.6))
    assert change == pytest.approx({"prefill": 1.5, "decode": 0.75})
    # too few prefill steps in either log: only decode is compared
    assert speed_change(profile, log(1.2, 0.8), log(1.8, 0.6, prefills=MIN_STEPS - 1)) == pytest.approx(
        {"decode": 0.75})


def test_a_first_token_overhead_delays_every_first_token_and_no_later_one():
    profile = Profile("hand", (0.1, 0.001, 0.0), (0.01, 0.002, 1e-5), 1000, 1e6, max_num_batched_tokens=512)
    work = [SimRequest(0.0, 300, 5), SimRequest(0.2, 100, 1), SimRequest(0.4, 200, 8)]
    plain = simulate(profile, work, prefill=1, decode=1)
    slow = simulate(replace(profile, first_token_overhead_s=0.25), work, prefill=1, decode=1)
    assert slow.ttft_s == pytest.approx([t + 0.25 for t in plain.ttft_s])
    assert slow.tpot_s == pytest.approx(plain.tpot_s)
    colocated = simulate(replace(profile, first_token_overhead_s=0.25), work, 0, 1, colocated=True)
    assert colocated.ttft_s == pytest.approx([t + 0.25 for t in simulate(profile, work, 0, 1, True).ttft_s])


def test_first_token_calibration_takes_the_median_gap_and_replaces_an_earlier_one(tmp_path):
    from pdserve.cluster.planner.calibrate import with_first_token_overhead

    profile = Profile("m", (0.02, 0.001, 1e-7), (0.03, 0.002, 1e-6), 1000, 1e9)
    work = [SimRequest(0.5 * i, 100 + 50 * i, 4) for i in range(9)]
    simulated = simulate(profile, work, 1, 1).ttft_s
    # 7 of 9 requests reached their client 0.2 s after the model's first token; two queued
    # behind something the simulation did not have, seconds later; one failed (None)
    measured = [t + 0.2 for t in simulated]
    measured[3] += 3.0
    measured[7] += 5.0
    measured[8] = None
    calibrated = with_first_token_overhead(profile, measured, simulated)
    assert calibrated.first_token_overhead_s == pytest.approx(0.2)
    assert calibrated.samples["serving_calibration"]["first_token_overhead_s"] == pytest.approx(0.2)
    again = simulate(calibrated, work, 1, 1).ttft_s  # the calibrated model reproduces the typical request
    assert again[:3] == pytest.approx(measured[:3])
    # re-calibrating against its own simulation keeps it rather than adding to it
    assert with_first_token_overhead(calibrated, measured, again).first_token_overhead_s == pytest.approx(0.2)
    # a serving path faster than the model (clock skew, a lucky run) is no negative overhead
    assert with_first_token_overhead(profile, [t - 0.1 for t in simulated], simulated).first_token_overhead_s == 0
    with pytest.raises(ValueError, match="no request has both"):
        with_first_token_overhead(profile, [None] * 9, simulated)
    path = tmp_path / "profile.json"  # saved and loaded with the profile
    path.write_text(calibrated.to_json())
    assert Profile.load(path).first_token_overhead_s == pytest.approx(0.2)
    path.write_text(json.dumps({**json.loads(calibrated.to_json()), "first_token_overhead_s": -1}))
    with pytest.raises(ValueError, match="first_token_overhead_s"):
        Profile.load(path)


def test_cpu_split_shares_each_engines_step_time_between_its_thread_its_process_and_the_rest():
    from pdserve.cluster.planner.calibrate import calibrate, cpu_split

    steps = [{"name": "decode", "s": 0.10, "u": 0.08, "p": 0.09},  # 80% own, 10% threads, 10% other
             {"name": "decode", "s": 0.30, "u": 0.24, "p": 0.27},
             {"name": "prefill", "s": 1.0, "u": 0.9, "p": 0.95},
             {"name": "decode", "s": 0.2}]  # logged before the split: left out
    split = cpu_split(steps)
    assert split["decode"] == pytest.approx({"own": 0.8, "threads": 0.1, "other": 0.1})
    assert split["prefill"] == pytest.approx({"own": 0.9, "threads": 0.05, "other": 0.05})
    assert cpu_split([{"name": "decode", "s": 0.2}]) == {}
    logged = [{**step, "t": float(i), "T": 0, "Q": 0, "K": 0, "B": 4, "C": 400, "u": 0.02, "p": 0.03}
              for i, step in enumerate({"name": "decode", "s": 0.04} for _ in range(6))]
    record = calibrate(PROFILE, logged).samples["serving_calibration"]
    assert record["cpu_split"]["decode"] == pytest.approx({"own": 0.5, "threads": 0.25, "other": 0.25})
