"""`pdserve up | status | scale | down`: run and operate the service on Ray."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

ADDRESS_HELP = ("Ray cluster address; `auto`: this machine's Ray, as on a `ray up` head (default: the local Ray "
                "that `pdserve up` started)")
RAY_SECURITY_EPILOG = """\
Ray is closed by default: a local head listens on 127.0.0.1 only and Ray's token auth is on
(the token is Ray's default file, ~/.ray/auth_token, created on first start). Every pdserve
command uses it. Ray's own CLI needs the same settings: `pdserve ray status` (or
`RAY_AUTH_MODE=token RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 ray status --address 127.0.0.1:6379`).
RAY_AUTH_MODE=disabled turns token auth off (pdserve warns)."""


def _routers_flag() -> str:
    """The flag of `router.replicas`, as the router's settings declare it (`--routers`)."""
    from pdserve.engine.arg_utils import config_options
    from pdserve.router.config import RouterSettings

    (option,) = [o for o in config_options(RouterSettings) if o.path == ("replicas",)]
    return option.flag


def add_commands(sub) -> None:
    routers_flag = _routers_flag()
    up = sub.add_parser("up", help="start the router and the prefill and decode pools on Ray",
                        description="Start pdserve: a Ray head here (unless --address), the cluster "
                                    "controller, the pools and the router. Runs in the foreground "
                                    "(Ctrl-C stops everything; it also exits when `pdserve down` or the loss "
                                    "of its Ray cluster ends the service) unless --detach.",
                        epilog=RAY_SECURITY_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    up.add_argument("--config", default=None,
                    help="deployment YAML (default: one machine, as documented in deploy/local.yaml)")
    up.add_argument("--address", default=None, help="Ray cluster to join (default: local, started if needed)")
    up.add_argument("--model", default=None, help="override `model`")
    up.add_argument("--host", default=None, help="override `router.host`")
    up.add_argument("--port", type=int, default=None, help="override `router.port`")
    up.add_argument("--prefill", type=int, default=None, help="override `prefill.replicas`")
    up.add_argument("--decode", type=int, default=None, help="override `decode.replicas`")
    up.add_argument(routers_flag, dest="routers", type=int, default=None,
                    help="override `router.replicas`: router processes serving the one port")
    up.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="override any config field, e.g. --set decode.engine.max_num_seqs=64")
    up.add_argument("--plan", default=None, help="start pools of the sizes in a `pdserve plan` file")
    up.add_argument("--detach", action="store_true", help="return once serving; `pdserve down` stops it")
    up.set_defaults(func=_up)

    status = sub.add_parser("status", help="pools, workers, load and KV usage")
    status.add_argument("--address", default=None, help=ADDRESS_HELP)
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--watch", action="store_true", help="refresh the table until Ctrl-C (like `watch`)")
    status.add_argument("--interval", type=float, default=2.0, metavar="SECONDS",
                        help="seconds between refreshes with --watch (default: 2)")
    status.set_defaults(func=_status)

    scale = sub.add_parser("scale", help="resize the prefill and/or decode pool, or the router replicas")
    scale.add_argument("--address", default=None, help=ADDRESS_HELP)
    scale.add_argument("--prefill", type=int, default=None, help="prefill workers wanted (pins the pool)")
    scale.add_argument("--decode", type=int, default=None, help="decode workers wanted (pins the pool)")
    scale.add_argument(routers_flag, dest="routers", type=int, default=None,
                       help="router replicas wanted (extra ones finish their open requests, then stop)")
    scale.add_argument("--plan", default=None, help="apply the pool sizes of a `pdserve plan` file")
    scale.add_argument("--auto", action="store_true", help="hand both pools back to the autoscaler (clears pins)")
    scale.add_argument("--no-wait", action="store_true", help="return before workers are ready/drained")
    scale.set_defaults(func=_scale)

    down = sub.add_parser("down", help="stop the service (and the local Ray that `up` started)",
                          description="Stop pdserve. Without --address, also stop the local Ray that "
                                      "`pdserve up` started (that one only: never another Ray on this machine).")
    down.add_argument("--address", default=None, help=ADDRESS_HELP)
    down.set_defaults(func=_down)

    ray_cli = sub.add_parser("ray", help="run Ray's own CLI against the local pdserve cluster (e.g. `status`)",
                             description="Run `ray ARGS...` with the address, token auth and loopback settings "
                                         "of the local Ray that `pdserve up` started.",
                             epilog=RAY_SECURITY_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ray_cli.add_argument("ray_args", nargs=argparse.REMAINDER, metavar="ARGS", help="e.g. status, list actors")
    ray_cli.set_defaults(func=_ray)


def _overrides(args) -> dict:
    out = {}
    if getattr(args, "plan", None):
        from pdserve.cluster.cli_planner import replicas_from_plan

        out.update(replicas_from_plan(args.plan))
    for key, value in (("model", args.model), ("router.host", args.host), ("router.port", args.port),
                       ("prefill.replicas", args.prefill), ("decode.replicas", args.decode),
                       ("router.replicas", getattr(args, "routers", None))):
        if value is not None:
            out[key] = value
    for item in args.set:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def _up(args) -> int:
    from pdserve.cluster.config import load_config
    from pdserve.cluster.ray_cluster import auth_enabled, connect

    config = load_config(args.config, _overrides(args))
    needed = sum(config.pool(r).num_cpus * config.pool(r).replicas for r in ("prefill", "decode"))
    local_ray = connect(args.address, start_if_missing=True,
                        num_cpus=max(os.cpu_count() or 1, int(needed * 2 + 0.999)))
    import ray

    from pdserve.cluster.controller import controller_handle, create_controller

    try:
        controller_handle()
        raise ValueError("pdserve is already up on this Ray cluster; `pdserve status`, or `pdserve down` first")
    except ValueError as exc:
        if "already up" in str(exc):
            raise
    controller = create_controller(config)
    routers = f" and {config.router.replicas} router replicas" if config.router.replicas > 1 else ""
    print(f"starting {config.prefill.replicas} prefill + {config.decode.replicas} decode worker(s){routers} "
          f"of {config.model} ...", file=sys.stderr, flush=True)
    started = time.monotonic()
    try:
        url = ray.get(controller.start.remote())
    except Exception as exc:  # noqa: BLE001 - report, then clean up what started
        print(f"pdserve: start-up failed: {_root_cause(exc)}", file=sys.stderr)
        _teardown(controller, local_ray)
        return 1
    dtypes = _dtypes(ray.get(controller.status.remote()))
    print(f"pdserve is serving {config.name} at {url}/v1 (ready in {time.monotonic() - started:.1f}s; "
          f"{dtypes})", flush=True)
    if local_ray is not None:
        print(f"Ray: a local head on {local_ray.address}, token auth "
              f"{'on' if auth_enabled() else 'OFF'}; `pdserve ray status` runs Ray's CLI against it",
              file=sys.stderr, flush=True)
    if "every worker" not in dtypes:
        print("warning: the pools run different dtypes, so their KV cannot be shipped between them and "
              "every request is prefilled on its decode worker; set the same engine.dtype in both pools",
              file=sys.stderr, flush=True)
    if args.detach:
        return 0
    print("Ctrl-C to stop", file=sys.stderr, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    gone = _wait_until_stopped_or_gone(stop, local_ray)
    if gone:
        print(f"pdserve: {gone}; exiting", file=sys.stderr, flush=True)
        if local_ray is not None and local_ray.running():
            local_ray.stop()
        return 0
    print("stopping ...", file=sys.stderr, flush=True)
    _teardown(controller, local_ray)
    return 0


def _wait_until_stopped_or_gone(stop: threading.Event, local_ray, check_every_s: float = 2.0) -> str:
    """Wait for Ctrl-C/SIGTERM (returns "") or for the service to go without us: taken down
    by `pdserve down` from another shell, or its Ray cluster gone (returns why)."""
    unanswered = 0
    while not stop.wait(check_every_s):
        if local_ray is not None and not local_ray.running():
            return f"its Ray cluster ({local_ray.address}) stopped"
        answer = _ask_controller(timeout_s=15)
        if answer == "gone":
            return "the service was taken down (its controller is gone)"
        unanswered = unanswered + 1 if answer == "no answer" else 0
        if unanswered >= 3:
            return "its Ray cluster does not answer"
    return ""


def _ask_controller(timeout_s: float) -> str:
    """"up", "gone" or "no answer": whether the controller is registered. Ray calls block
    while the GCS is unreachable, so the question runs on a daemon thread with a deadline."""
    from pdserve.cluster.controller import controller_handle

    answer = ["no answer"]

    def ask():
        try:
            controller_handle()
            answer[0] = "up"
        except ValueError:
            answer[0] = "gone"
        except Exception:  # noqa: BLE001 - the cluster itself is failing
            answer[0] = "no answer"

    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    asker.join(timeout_s)
    return answer[0]


def _teardown(controller, local_ray) -> None:
    """Stop the service, then the local Ray this process started (if it did), nothing else."""
    import ray

    from pdserve.cluster.controller import kill_service_actors

    try:
        ray.get(controller.shutdown.remote(), timeout=60)
    except Exception:  # noqa: BLE001 - best effort, the actor is killed next
        pass
    try:
        ray.kill(controller, no_restart=True)
        kill_service_actors()
    except Exception:  # noqa: BLE001 - already gone
        pass
    ray.shutdown()
    if local_ray is not None:
        local_ray.stop()


def _root_cause(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__


def _controller(address):
    from pdserve.cluster.ray_cluster import connect

    connect(address)
    from pdserve.cluster.controller import controller_handle

    try:
        return controller_handle()
    except ValueError:
        raise ValueError("pdserve is not running on this Ray cluster; start it with `pdserve up`") from None


def _ask(call, restart_wait_s: float = 60.0):
    """`ray.get(call())`, asked again while Ray restarts the controller (it re-adopts the
    service within seconds) rather than failing an operator's command on that moment."""
    import ray
    from ray.exceptions import ActorUnavailableError

    deadline = time.monotonic() + restart_wait_s
    while True:
        try:
            return ray.get(call())
        except ActorUnavailableError:
            if time.monotonic() > deadline:
                raise ValueError("the pdserve controller is restarting and did not come back in "
                                 f"{restart_wait_s:.0f}s; try again, or see `pdserve ray status`") from None
            time.sleep(1.0)


def _dtypes(status: dict) -> str:
    """The workers' dtypes, e.g. "bfloat16 on every worker" or "prefill float32, decode bfloat16"."""
    by_pool = {role: sorted({w["dtype"] for w in pool["workers"] if w.get("dtype")})
               for role, pool in status["pools"].items()}
    names = {d for ds in by_pool.values() for d in ds}
    if len(names) == 1:
        return f"{names.pop()} on every worker"
    return ", ".join(f"{role} {'/'.join(ds) or '-'}" for role, ds in by_pool.items())


def _status(args) -> int:
    if args.watch and args.interval <= 0:
        raise ValueError(f"--interval must be > 0, got {args.interval}")
    controller = _controller(args.address)
    import ray

    if args.watch:
        return watch_status(lambda: ray.get(controller.status.remote(), timeout=30), args.interval, args.json)
    status = _ask(lambda: controller.status.remote())
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    print_status(status)
    return 0


CLEAR_SCREEN = "\x1b[H\x1b[2J"


def watch_status(fetch, interval_s: float, as_json: bool = False, sleep=time.sleep) -> int:
    """Fetch and print the status every `interval_s` on a cleared screen until Ctrl-C; a
    fetch that fails (the controller restarting) is shown and tried again next time."""
    try:
        while True:
            try:
                status = fetch()
            except Exception as exc:  # noqa: BLE001 - shown, retried at the next refresh
                status, error = None, _root_cause(exc)
            print(CLEAR_SCREEN + f"pdserve status, every {interval_s:g}s ({time.strftime('%H:%M:%S')}; "
                  "Ctrl-C to stop)")
            if status is None:
                print(f"status unavailable: {error}")
            elif as_json:
                print(json.dumps(status, indent=2))
            else:
                print_status(status)
            sys.stdout.flush()
            sleep(interval_s)
    except KeyboardInterrupt:
        print()
        return 0


def print_status(status: dict) -> None:
    sim = status.get("simulated")
    simulated = (f" (simulated: the tokenizer and shapes of {sim['like']}, step times of "
                 f"{sim['profile'] or 'the committed profile'} at speed {sim['speed']:g}, no weights)") if sim else ""
    print(f"router: {status['router']}   model: {status['model']}{simulated}")
    replicas = status.get("routers") or []
    if len(replicas) > 1 or status.get("router_target", 1) != 1:
        print(f"router replicas: target {status.get('router_target', len(replicas))}, {len(replicas)} running")
    for r in replicas:
        node = f"  node {r['node']}" if r.get("node") else ""
        print(f"  router {r['replica']:<3} {r.get('name', ''):20} {r['address'] or '-':22} pid {r['pid'] or '-'!s:>7}  "
              f"{r['state']}{node}")
    routing = status.get("routing") or {}
    index = routing.get("index", {})
    if routing:
        expected, actual = routing["expected_cached_tokens"], routing["actual_cached_tokens"]
        print(f"routing: {routing['policy']}   cached prompt tokens: the router expected {expected}, "
              f"the workers found {actual}")
    for role, pool in status["pools"].items():
        pending = pool.get("pending", 0)
        short = f", {pending} pending: no node with room" if pending else ""
        print(f"{role} pool: target {pool['target']}, {len(pool['workers'])} worker(s){short}")
        for w in pool["workers"]:
            s = w.get("stats") or {}
            total = s.get("num_total_blocks") or 0
            kv = f"{100 * (1 - s.get('num_free_blocks', 0) / total):.1f}%" if total else "-"
            looked_up = s.get("prefix_cache_query_tokens") or 0
            hit = f"{100 * s.get('prefix_cache_hit_tokens', 0) / looked_up:.1f}%" if looked_up else "-"
            held = index.get(w["worker_id"], {})
            indexed = f"{held['held']}+{held['expected']}" if held else "-"
            print(f"  {w['worker_id'] or '(' + w['state'] + ')':14} {w['address'] or '-':22} "
                  f"node {w.get('node') or '-':15} {w['state']:9} "
                  f"{w.get('dtype') or '-':8}  threads {w.get('num_threads') or '-'!s:>2}  "
                  f"running {s.get('num_running', '-')!s:>4}  waiting {s.get('num_waiting', '-')!s:>4}  "
                  f"queued prefill tokens {s.get('queued_prefill_tokens', '-')!s:>6}  KV used {kv}  "
                  f"cache hits {hit}{_tier_hits(s, looked_up)}  router index {indexed} blocks")
    auto = status.get("autoscaler") or {}
    if auto.get("enabled"):
        overridden = ", ".join(auto["overridden"]) or "none"
        print(f"autoscaler: on (operator overrides: {overridden})")
        for d in auto["decisions"][-3:]:
            obs = d["observed"]
            print(f"  {time.strftime('%H:%M:%S', time.localtime(d['time']))} rate {obs.get('rate', 0):.2f}/s "
                  f"TTFT p {obs.get('ttft_p') or 0:.2f}s TPOT p {1000 * (obs.get('tpot_p') or 0):.0f}ms "
                  f"correction {d['correction']} desired {d['desired']} action {d['action'] or 'none'}")
    print("recent events:")
    for e in status["events"][-8:]:
        print(f"  {time.strftime('%H:%M:%S', time.localtime(e['time']))} {e['role']:8} {e['event']:12} "
              f"{e['worker_id']} {e['detail']}")


def _tier_hits(stats: dict, looked_up: int) -> str:
    """A worker's second-KV-tier hits beside its cache hits in `pdserve status` (of the same
    prompt tokens looked up) and the node's store as it reads it; "" while its tier is off."""
    store = stats.get("kv_tier_store") or {}
    if not store:
        return ""
    hit = f"{100 * stats.get('kv_tier_hit_tokens', 0) / looked_up:.1f}%" if looked_up else "-"
    return f" + tier {hit} (node store {stats.get('kv_tier_bytes', 0) / 2**20:.0f} MiB, {store.get('files', 0)} blocks)"


def _scale(args) -> int:
    if args.plan:
        from pdserve.cluster.cli_planner import replicas_from_plan

        sizes = replicas_from_plan(args.plan)
        args.prefill, args.decode = sizes["prefill.replicas"], sizes["decode.replicas"]
    controller = _controller(args.address)
    if args.auto:
        _ask(lambda: controller.clear_override.remote())
        print("both pools and the router replica count are back under the autoscaler")
        if args.prefill is None and args.decode is None and args.routers is None:
            return 0
    if args.prefill is None and args.decode is None and args.routers is None:
        raise ValueError(f"give --prefill N, --decode M and/or {_routers_flag()} R, --plan FILE, or --auto")
    targets = _ask(lambda: controller.scale.remote(prefill=args.prefill, decode=args.decode, wait=not args.no_wait,
                                                   routers=args.routers))
    routers = f", router replicas {targets['routers']}" if "routers" in targets else ""
    print(f"pools now: prefill {targets['prefill']}, decode {targets['decode']}{routers}")
    return 0


def _down(args) -> int:
    from pdserve.cluster.ray_cluster import stop_recorded_local_ray

    try:
        controller = _controller(args.address)
    except ValueError:
        stopped = False if args.address else stop_recorded_local_ray()
        print("pdserve was not running" + ("; stopped the local Ray it had started" if stopped else ""))
        return 0
    import ray

    from pdserve.cluster.controller import kill_service_actors

    try:
        ray.get(controller.shutdown.remote(), timeout=60)
    finally:
        ray.kill(controller, no_restart=True)  # Ray would restart it otherwise
        kill_service_actors()
        ray.shutdown()
    stopped = False if args.address else stop_recorded_local_ray()
    print("pdserve stopped" + ("; stopped the local Ray that `pdserve up` started" if stopped else ""))
    return 0


def _ray(args) -> int:
    """Ray's own CLI against the local pdserve cluster (address, token auth, loopback node)."""
    from pdserve.cluster.ray_cluster import ray_cli_env, ray_executable

    return subprocess.run([ray_executable(), *args.ray_args], env=ray_cli_env()).returncode
