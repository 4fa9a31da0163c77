"""Connecting to Ray; the local Ray head that `pdserve up` starts, reachable from this
machine only and with Ray's token auth on; stopping it again, and nothing else.

Closed by default:

- **Loopback only.** Ray binds its GCS and raylets to every interface unless the node's
  address is loopback, and `ray start` rewrites `--node-ip-address=127.0.0.1` to the
  host's network address unless `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` (Ray's single-host
  mode, the default on macOS and Windows). So a local head, and every process that talks
  to it, runs with that variable: Ray then takes 127.0.0.1 as the node's address and
  every socket of the cluster listens there (a test reads them from the process table).
- **Token auth on.** `RAY_AUTH_MODE=token` unless the operator set `RAY_AUTH_MODE`
  (`disabled` is their explicit choice, and pdserve warns). The token is Ray's own default
  file, `~/.ray/auth_token`, created (mode 0600) when a local head starts without one;
  a cluster joined with `--address` must already have one everywhere (Ray's way: `ray
  get-auth-token --generate`, then copy the file to every node; deploy/cluster.yaml does).
- **A lifecycle that touches no other cluster.** The state file records the local Ray that
  `pdserve up` started (GCS address, session directory). Commands without `--address`
  connect to that one, never to whatever Ray `auto` finds; `pdserve down` stops that one
  by its session's processes, never with `ray stop` (which stops every Ray on the machine).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.engine.model_source import cache_dir

logger = logging.getLogger(__name__)
NAMESPACE = "pdserve"
LOCAL_HOST = "127.0.0.1"
DEFAULT_GCS_PORT = 6379
SINGLE_HOST_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray takes loopback as the node's address
AUTH_MODE_ENV = "RAY_AUTH_MODE"
_TOKEN_ENVS = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def run_dir() -> Path:
    """Where pdserve records the local Ray it started: `$PDSERVE_RUN_DIR`, default the cache."""
    return Path(os.environ.get("PDSERVE_RUN_DIR") or cache_dir())


def state_file() -> Path:
    return run_dir() / "local-ray.json"


def token_path() -> Path:
    """Ray's default token file (what Ray reads when no RAY_AUTH_TOKEN[_PATH] is set)."""
    return Path.home() / ".ray" / "auth_token"


def auth_enabled() -> bool:
    return os.environ.get(AUTH_MODE_ENV, "token").lower() == "token"


def ray_env(local: bool) -> None:
    """Set Ray's environment for this process and the Ray processes it starts; call before
    `import ray` (Ray reads some of it at import). `local`: the cluster is a loopback head."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if AUTH_MODE_ENV not in os.environ:
        os.environ[AUTH_MODE_ENV] = "token"
    elif not auth_enabled():
        print(f"pdserve: warning: {AUTH_MODE_ENV}={os.environ[AUTH_MODE_ENV]}: Ray's token auth is off, so "
              "anyone who can reach this Ray cluster's ports can run code as this user and read its "
              f"secrets; unset {AUTH_MODE_ENV} to turn it back on", file=sys.stderr, flush=True)
    if local:
        os.environ[SINGLE_HOST_ENV] = "0"
    else:
        os.environ.pop(SINGLE_HOST_ENV, None)
    if "ray" in sys.modules:  # imported already: Ray read these at import; refresh as Ray itself does
        import ray._private.ray_constants as ray_constants
        from ray._raylet import Config

        ray_constants.ENABLE_RAY_CLUSTER = not local
        Config.initialize("")


def ensure_token() -> None:
    """Create Ray's default token file (0600) unless a token is configured or exists."""
    if not auth_enabled() or any(os.environ.get(name) for name in _TOKEN_ENVS) or token_path().exists():
        return
    import secrets

    token_path().parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(token_path(), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another pdserve created it just now
        return
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    print(f"pdserve: created Ray's auth token in {token_path()}", file=sys.stderr, flush=True)


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


@dataclass(frozen=True)
class LocalRay:
    """A Ray head that pdserve started on this machine, named by its GCS address and its
    session directory (every process of that cluster has the directory on its command
    line, or descends from one that has)."""

    address: str
    session_dir: str

    def processes(self) -> list:
        import psutil

        found = {}
        for p in psutil.process_iter(["cmdline"]):
            if self.session_dir in " ".join(p.info["cmdline"] or ()):
                found[p.pid] = p
                try:
                    found.update((c.pid, c) for c in p.children(recursive=True))
                except psutil.Error:
                    pass
        found.pop(os.getpid(), None)
        return list(found.values())

    def running(self) -> bool:
        """Whether this cluster's GCS is still up."""
        import psutil

        for p in self.processes():
            try:
                if p.name() == "gcs_server":
                    return True
            except psutil.Error:
                continue
        return False

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Terminate every process of this cluster (SIGKILL after `timeout_s`); returns
        whether any was running. Forgets the state file if it names this cluster."""
        import psutil

        procs = self.processes()
        for p in procs:
            try:
                p.terminate()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(procs, timeout=timeout_s)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        if recorded_local_ray() == self:
            state_file().unlink(missing_ok=True)
        return bool(procs)


def recorded_local_ray() -> LocalRay | None:
    try:
        return LocalRay(**json.loads(state_file().read_text()))
    except (OSError, ValueError, TypeError):
        return None


def ray_executable() -> str:
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.exists() else (shutil.which("ray") or "ray")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((LOCAL_HOST, port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOCAL_HOST, 0))
        return s.getsockname()[1]


def _session_listening_on(port: int) -> str:
    """The session directory of the GCS listening on `port` on this machine."""
    import psutil

    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            for arg in psutil.Process(conn.pid).cmdline():
                if arg.startswith("--session-dir="):
                    return arg.split("=", 1)[1]
    raise RuntimeError(f"no Ray GCS listens on port {port} after `ray start`")


def start_local_head(num_cpus: int) -> LocalRay:
    """`ray start --head` on loopback with token auth (see the module docstring); recorded."""
    ray_env(local=True)
    ensure_token()
    port = DEFAULT_GCS_PORT if _port_free(DEFAULT_GCS_PORT) else _free_port()
    logger.warning("starting a local Ray head node on %s:%d (%d CPUs)", LOCAL_HOST, port, num_cpus)
    log_path = run_dir() / "ray-start.log"  # not our stderr: Ray's daemons would keep writing to it
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        started = subprocess.run([ray_executable(), "start", "--head", f"--node-ip-address={LOCAL_HOST}",
                                  f"--port={port}", f"--num-cpus={num_cpus}", "--include-dashboard=false",
                                  "--disable-usage-stats", "--object-store-memory=500000000"],
                                 stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if started.returncode != 0:
        raise RuntimeError(f"`ray start` failed (exit {started.returncode}); its output, {log_path}:\n"
                           + log_path.read_text()[-3000:])
    local = LocalRay(f"{LOCAL_HOST}:{port}", _session_listening_on(port))
    state_file().parent.mkdir(parents=True, exist_ok=True)
    state_file().write_text(json.dumps(asdict(local)))
    return local


def _init(address: str) -> None:
    import ray

    ray.init(address=address, namespace=NAMESPACE, logging_level="WARNING", log_to_driver=False)


def connect(address: str | None, start_if_missing: bool = False, num_cpus: int | None = None) -> LocalRay | None:
    """Connect this process to Ray: `address` when given (`auto`: this machine's Ray, as on a
    `ray up` head); else the local Ray that `pdserve up` started; else (`start_if_missing`) a
    new local head, returned so its starter can stop it. Never a Ray it was not told about."""
    if address:
        ray_env(local=is_loopback(address))
        _init(address)
        return None
    recorded = recorded_local_ray()
    if recorded is not None and recorded.running():
        ray_env(local=True)
        _init(recorded.address)
        return None
    if not start_if_missing:
        raise ValueError("pdserve is not running here (no local Ray that `pdserve up` started); start it "
                         "with `pdserve up`, or give --address (on a `ray up` cluster's head: --address auto)")
    local = start_local_head(num_cpus or os.cpu_count() or 1)
    _init(local.address)
    return local


def init_private_cluster(num_cpus: int, object_store_memory: int = 300_000_000) -> None:
    """Start a Ray cluster of this process's own (benchmarks, tests), closed as `pdserve up`'s
    is: on loopback, with token auth; never one that happens to run here (`address="local"`)."""
    ray_env(local=True)
    ensure_token()
    import ray

    ray.init(address="local", num_cpus=num_cpus, namespace=NAMESPACE, include_dashboard=False,
             object_store_memory=object_store_memory, logging_level="WARNING", log_to_driver=False)


def stop_recorded_local_ray() -> bool:
    """Stop the local Ray that the state file names (`pdserve down`); returns whether it ran."""
    recorded = recorded_local_ray()
    if recorded is None:
        return False
    stopped = recorded.stop()
    state_file().unlink(missing_ok=True)
    return stopped


def ray_cli_env() -> dict:
    """The environment in which Ray's own CLI (`ray status`, `ray list actors`, ...) reaches
    the local pdserve cluster: its address, token auth and loopback node."""
    env = dict(os.environ)
    env.setdefault(AUTH_MODE_ENV, "token")
    recorded = recorded_local_ray()
    if recorded is not None:
        env.setdefault("RAY_ADDRESS", recorded.address)
        env[SINGLE_HOST_ENV] = "0"
    return env
