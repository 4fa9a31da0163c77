"""`pdserve profile` and `pdserve plan`: measure this hardware, then size the pools."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

DEFAULT_TRACE = Path(__file__).resolve().parent.parent.parent / "shared" / "workloads" / "online-poisson.jsonl"
_SIMULATED = {"local_prefill_max_tokens": "the decode workers' setting, simulated: they prefill a prompt themselves "
                                          "when their cache lacks at most this many tokens"}


def add_commands(sub) -> None:
    from pdserve.engine.arg_utils import add_engine_args

    prof = sub.add_parser("profile", help="measure prefill/decode step times and KV bandwidth here",
                          description="Run the real engine on this machine and fit the latency models "
                                      "the planner uses. Pin it like a worker (e.g. taskset -c 0, "
                                      "OMP_NUM_THREADS=1) to profile one worker's share.")
    prof.add_argument("--out", required=True, help="profile JSON to write")
    prof.add_argument("--repeats", type=int, default=3, help="timed runs per measured point (median; default: 3)")
    add_engine_args(prof)
    prof.set_defaults(func=_profile)

    cal = sub.add_parser("calibrate", help="scale a profile to what serving steps took (a step log)",
                         description="Serving adds CPU work the engine-alone profile cannot see (router, "
                                     "clients, the worker's own streaming and KV-transfer threads). Record a "
                                     "step log while serving (PDSERVE_STEP_LOG=DIR in the workers' "
                                     "environment), then scale each kind of step (prefill, decode, mixed) by "
                                     "its measured over its predicted time in all.")
    cal.add_argument("--profile", required=True, help="JSON from `pdserve profile`")
    cal.add_argument("--step-log", required=True, help="directory of the workers' step logs")
    cal.add_argument("--name", default="", help="only engines whose log names start with this (prefill, decode)")
    cal.add_argument("--out", required=True, help="calibrated profile JSON to write")
    cal.add_argument("--first-token-overhead", type=float, default=None, metavar="SECONDS",
                     help="serving's fixed cost of a first token beyond the engine steps that make it (HTTP, "
                          "router, RPCs, streaming), added to every simulated TTFT: e.g. a lone short "
                          "request's TTFT through the router minus the calibrated profile's prefill time "
                          "for it (default: the profile's own, 0 for a fresh one)")
    cal.set_defaults(func=_calibrate)

    plan = sub.add_parser("plan", help="instances per pool to meet TTFT/TPOT SLOs at a rate",
                          description="Simulate the pools with a profile and find how many prefill and "
                                      "decode instances meet the SLOs (and the best colocated "
                                      "configuration for comparison).")
    plan.add_argument("--profile", required=True, help="JSON from `pdserve profile`")
    plan.add_argument("--ttft-slo", required=True, type=_seconds, help="e.g. 2s or 500ms")
    plan.add_argument("--tpot-slo", required=True, type=_seconds, help="e.g. 150ms")
    plan.add_argument("--percentile", type=float, default=90.0, help="SLO percentile of TTFT and TPOT (default: 90)")
    plan.add_argument("--rate", type=float, default=None, help="requests/s (default: the trace's rate)")
    plan.add_argument("--trace", default=None, help=f"workload JSONL for lengths (default: {DEFAULT_TRACE.name})")
    plan.add_argument("--prefix-hit-rate", type=float, default=None,
                      help="fraction of prompt tokens found in prefix caches, e.g. `pdserve status`'s cache "
                           "hits (default: measured from the trace's token ids; 0 when it has only lengths)")
    from pdserve.engine.arg_utils import add_config_args
    from pdserve.worker_base.config import WorkerSettings

    add_config_args(plan, WorkerSettings, exclude=_not_simulated(), helps=_SIMULATED)
    plan.add_argument("--out", default="plan.yaml", help="plan to write (for `pdserve up/scale --plan`)")
    plan.add_argument("--png", default=None, help="attainment-vs-rate plot (default: beside --out)")
    plan.set_defaults(func=_plan)


def _not_simulated() -> tuple[str, ...]:
    """The workers' settings (WorkerSettings) that `pdserve plan` does not simulate."""
    from pdserve.worker_base.config import WorkerSettings

    return tuple(name for name in WorkerSettings.model_fields if name not in _SIMULATED)


def _simulated_settings(args):
    """The workers' settings `pdserve plan` simulates, from its flags (the others' defaults)."""
    from pdserve.engine.arg_utils import config_from_args
    from pdserve.worker_base.config import WorkerSettings

    return config_from_args(WorkerSettings, args, exclude=_not_simulated())


def _seconds(text: str) -> float:
    text = text.strip().lower()
    try:
        if text.endswith("ms"):
            value = float(text[:-2]) / 1000
        else:
            value = float(text[:-1] if text.endswith("s") else text)
    except ValueError:
        raise ValueError(f"not a duration: {text!r} (use e.g. 2s or 150ms)") from None
    if value <= 0:
        raise ValueError(f"durations must be > 0, got {text!r}")
    return value


def _profile(args) -> int:
    from pdserve.cluster.planner.profiler import profile_engine
    from pdserve.engine.arg_utils import engine_config_from_args

    profile = profile_engine(engine_config_from_args(args), args.repeats,
                             progress=lambda m: print(m, file=sys.stderr, flush=True))
    Path(args.out).write_text(profile.to_json())
    print(f"wrote {args.out}: prefill {profile.prefill_coeffs}, decode {profile.decode_coeffs}")
    return 0


def _calibrate(args) -> int:
    from dataclasses import replace

    from pdserve.cluster.planner.calibrate import calibrate
    from pdserve.engine.profile import Profile
    from pdserve.engine.step_log import read_step_logs

    profile = Profile.load(args.profile)
    steps = read_step_logs(args.step_log, args.name)
    if not steps:
        raise ValueError(f"no step records under {args.step_log} (set PDSERVE_STEP_LOG={args.step_log} in the "
                         f"workers' environment while they serve)")
    calibrated = calibrate(profile, steps)
    if args.first_token_overhead is not None:
        calibrated = replace(calibrated, first_token_overhead_s=args.first_token_overhead)
    Path(args.out).write_text(calibrated.to_json())
    record = calibrated.samples["serving_calibration"]
    print(f"wrote {args.out}: serving/engine-alone step time by kind {record['factors']} "
          f"(from {record['steps']} steps)")
    if "decode_terms" in record:  # calibrate.fit_decode_terms
        terms = record["decode_terms"]
        print(f"decode steps: x{terms['factor']:.2f}, +{terms['prefill_rate'] * 1e5:.0f}% of the step per 1,000 "
              f"prompt tokens/s the prefill engines in the log computed beside it")
    if "mixed_size" in record:  # calibrate.fit_mixed_size
        size = record["mixed_size"]
        print(f"mixed steps: serving's slowdown falls with their size, as (step / {size['reference_s']:.2f} s) ** "
              f"-{size['exponent']:.2f}")
    if "mixed_terms" in record:  # calibrate.fit_mixed_terms
        print(f"mixed steps: x{record['mixed_terms']['step']:.2f}, with the decode steps' co-tenancy term")
    for name, split in record.get("cpu_split", {}).items():  # calibrate.cpu_split
        print(f"{name} engines' step time: {split['own']:.0%} the stepping thread, {split['threads']:.0%} their "
              f"process's other threads, {split['other']:.0%} other processes or waiting for a core "
              f"(exact for engines of one torch thread)")
    return 0


def _plan(args) -> int:
    from pdserve.cluster.planner.search import SLO, make_plan
    from pdserve.cluster.planner.workload import hit_rate, load_trace, trace_rate, with_hit_rate
    from pdserve.engine.profile import Profile

    profile = Profile.load(args.profile)
    trace = load_trace(args.trace or DEFAULT_TRACE)
    if args.prefix_hit_rate is not None:
        trace = with_hit_rate(trace, args.prefix_hit_rate)
    _simulated_settings(args)  # ValueError naming the flag of a bad value
    rate = args.rate or trace_rate(trace)
    slo = SLO(args.ttft_slo, args.tpot_slo, args.percentile)
    plan = make_plan(profile, slo, rate, trace, local_prefill_max_tokens=args.local_prefill_max_tokens)
    print(f"rate {rate:.3f} req/s, SLOs: TTFT p{slo.percentile:g} <= {slo.ttft_s}s, "
          f"TPOT p{slo.percentile:g} <= {slo.tpot_s * 1000:.0f}ms, prefix-cache hit rate {hit_rate(trace):.1%}, "
          f"local prefill up to {args.local_prefill_max_tokens} uncached tokens")
    print(plan.table())
    print(f"one instance sustains: prefill {plan.capacity['prefill']:.3f}/s, decode "
          f"{plan.capacity['decode']:.3f}/s, colocated {plan.capacity['colocated']:.3f}/s")
    if plan.note:
        print(plan.note)
    document = {"rate": rate, "prefix_hit_rate": hit_rate(trace),
                "local_prefill_max_tokens": args.local_prefill_max_tokens,
                "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "percentile": slo.percentile},
                "feasible": plan.feasible, "prefill": {"replicas": plan.prefill},
                "decode": {"replicas": plan.decode}, "colocated": {"replicas": plan.colocated},
                "capacity_per_instance": plan.capacity, "predicted": plan.predicted, "note": plan.note}
    Path(args.out).write_text(yaml.safe_dump(document, sort_keys=False))
    png = args.png or str(Path(args.out).with_suffix(".png"))
    plot_attainment(profile, slo, trace, plan, png, args.local_prefill_max_tokens)
    print(f"wrote {args.out} and {png}")
    return 0


def plot_attainment(profile, slo, trace, plan, path: str, local_prefill_max_tokens: int = 0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pdserve.cluster.planner.search import lengths_of, predict
    from pdserve.cluster.planner.workload import poisson

    rates = [plan.rate * f for f in (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)]
    lengths = lengths_of(trace)
    disagg, coloc = [], []
    for rate in rates:
        work = poisson(rate, 300, lengths, seed=2)
        disagg.append(predict(profile, slo, work, plan.prefill, plan.decode, False,
                              local_prefill_max_tokens)["attainment"])
        coloc.append(predict(profile, slo, work, 0, plan.colocated, True)["attainment"])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(rates, disagg, marker="o", label=f"disaggregated {plan.prefill}P+{plan.decode}D")
    ax.plot(rates, coloc, marker="s", label=f"colocated x{plan.colocated}")
    ax.axvline(plan.rate, color="grey", linestyle=":")
    ax.set_xlabel("requests/s")
    ax.set_ylabel(f"SLO attainment (TTFT {slo.ttft_s}s, TPOT {slo.tpot_s * 1000:.0f}ms)")
    ax.set_ylim(0, 1.05)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def replicas_from_plan(path: str) -> dict:
    """{"prefill.replicas": n, "decode.replicas": m} from a plan file; ValueError if malformed."""
    try:
        plan = yaml.safe_load(Path(path).read_text())
        return {"prefill.replicas": int(plan["prefill"]["replicas"]),
                "decode.replicas": int(plan["decode"]["replicas"])}
    except FileNotFoundError:
        raise ValueError(f"plan {path} not found") from None
    except (yaml.YAMLError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"plan {path}: needs prefill.replicas and decode.replicas ({exc})") from None
