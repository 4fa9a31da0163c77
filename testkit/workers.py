"""Start real prefill/decode worker processes for tests, and talk to them over gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from pdserve.protos import pdserve_pb2 as pb
from pdserve.protos import pdserve_pb2_grpc as pb_grpc
from pdserve.rpc.channel import open_channel
from pdserve.rpc.security import TOKEN_ENV, Security

ROOT = Path(__file__).resolve().parent.parent
CLUSTER_TOKEN = "testkit-cluster-token-0123456789"  # what the workers started here accept
SECURITY = Security(CLUSTER_TOKEN)


class _Process:
    """A pdserve subprocess with its output in `log_path`; a context manager."""

    proc: subprocess.Popen
    log_path: Path
    _log_tail = 4000

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()[-self._log_tail:]

    def log_offset(self) -> int:
        """Where the log ends now: `log_since(offset)` later reads only what came after."""
        return self.log_path.stat().st_size

    def log_since(self, offset: int) -> str:
        """All the log written after `offset` (a `log_offset()`), however long: a test that
        looks for its own case's lines must not find an earlier case's, nor lose its own
        past the tail that `log()` keeps."""
        with open(self.log_path, "rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _die_with_the_test_process() -> None:
    """`preexec_fn` of every process started here: if the test process is killed outright
    (the OOM killer, a CI timeout), the kernel kills its workers and routers too, instead of
    leaving them to hold memory and ports for the rest of the machine's run."""
    if sys.platform == "linux":
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class WorkerProcess(_Process):
    """A worker subprocess. Use as a context manager, or call `stop()`. A decode worker
    prefills every request remotely (`--local-prefill-max-tokens 0`) unless told otherwise,
    and a worker runs without the second KV tier (`--no-kv-tier-enabled`) unless the
    arguments name a `--kv-tier-*` flag: a test of another part counts the positions it
    computes and the KV it ships, which a node store that earlier tests filled would change."""

    def __init__(self, role: str, model: str, *args: str, ready_timeout_s: float = 180.0,
                 env: dict | None = None, launcher: tuple[str, ...] = ()) -> None:
        self.role = role
        if role == "decode" and "--local-prefill-max-tokens" not in args:
            args = (*args, "--local-prefill-max-tokens", "0")  # always remote: tests of the split
        if not any(arg.startswith("--kv-tier-") for arg in args):
            args = (*args, "--no-kv-tier-enabled")
        ready = Path(tempfile.mkdtemp()) / "ready"
        self.log_path = ready.with_name("log")
        cmd = [*launcher, sys.executable, "-m", f"{role}_worker", "--model", model, "--ready-file", str(ready), *args]
        self._log = open(self.log_path, "w")
        full_env = {**os.environ, TOKEN_ENV: CLUSTER_TOKEN, **(env or {})}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
                                     preexec_fn=_die_with_the_test_process)
        deadline = time.monotonic() + ready_timeout_s
        while not ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{role} worker exited {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{role} worker not ready after {ready_timeout_s}s:\n{self.log()}")
            time.sleep(0.1)
        self.address = ready.read_text().strip()


def decode_stub(address: str, security: Security = SECURITY) -> tuple[grpc.aio.Channel, pb_grpc.DecodeWorkerStub]:
    channel = open_channel(address, security)
    return channel, pb_grpc.DecodeWorkerStub(channel)


def prefill_stub(address: str, security: Security = SECURITY) -> tuple[grpc.aio.Channel, pb_grpc.PrefillWorkerStub]:
    channel = open_channel(address, security)
    return channel, pb_grpc.PrefillWorkerStub(channel)


def generate_request(request_id: str, ids: list[int], max_tokens: int, prefill: list[str],
                     transport: str = "torch", temperature: float = 0.0, seed: int | None = None,
                     top_p: float = 1.0, top_k: int = 0, logprobs: int | None = None) -> pb.GenerateRequest:
    sampling = pb.SamplingOptions(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                  top_k=top_k, ignore_eos=True)
    if seed is not None:
        sampling.seed = seed
    if logprobs is not None:
        sampling.logprobs = logprobs
    return pb.GenerateRequest(request_id=request_id, prompt_token_ids=ids, sampling=sampling,
                              prefill_addresses=prefill, kv_transport=transport)


async def collect(stub, request: pb.GenerateRequest) -> tuple[list[int], str, str]:
    """Run a Generate stream to its end: (token ids, finish reason, prefilled_by)."""
    tokens, finish, prefilled_by = [], "", ""
    async for chunk in stub.Generate(request):
        tokens.extend(chunk.token_ids)
        prefilled_by = prefilled_by or chunk.prefilled_by
        finish = chunk.finish_reason or finish
    return tokens, finish, prefilled_by


async def wait_idle(stub, timeout_s: float = 20.0) -> pb.WorkerStats:
    """Poll Stats until the worker holds no request and all blocks are free."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await stub.Stats(pb.StatsRequest())
        idle = stats.num_free_blocks == stats.num_total_blocks and not stats.num_running \
            and not stats.num_waiting and not stats.num_waiting_for_kv
        if idle or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.1)


async def stats_of(address: str, role: str) -> pb.WorkerStats:
    """One Stats answer of the worker at `address` ("prefill" or "decode")."""
    channel, stub = (decode_stub if role == "decode" else prefill_stub)(address)
    async with channel:
        return await stub.Stats(pb.StatsRequest())


async def wait_idle_at(address: str, role: str, timeout_s: float = 20.0) -> pb.WorkerStats:
    """`wait_idle` on the worker at `address` ("prefill" or "decode")."""
    channel, stub = (decode_stub if role == "decode" else prefill_stub)(address)
    async with channel:
        return await wait_idle(stub, timeout_s)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RouterProcess(_Process):
    """The bare router (`python -m pdserve.router`) over worker processes, its output in a log file.
    `env` values of None remove that variable. Use as a context manager, or call `stop()`."""

    _log_tail = 1 << 30  # tests read the whole log

    def __init__(self, model: str, prefill: list[str], decode: list[str], *args: str,
                 served_model_name: str = "tiny", env: dict | None = None, ready_timeout_s: float = 120.0) -> None:
        import urllib.request

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkdtemp()) / "router.log"
        cmd = [sys.executable, "-m", "pdserve.router", "--model", model, "--served-model-name", served_model_name,
               "--port", str(self.port), *(f"--prefill={a}" for a in prefill), *(f"--decode={a}" for a in decode),
               *args]
        full_env = {**os.environ, TOKEN_ENV: CLUSTER_TOKEN, **(env or {})}
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={k: v for k, v in full_env.items() if v is not None},
                                     preexec_fn=_die_with_the_test_process)
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:  # not listening yet, or 503 until a decode worker is known
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"router not ready after {ready_timeout_s}s:\n{self.log()}")
            time.sleep(0.2)


# The ways a request reaches its first token through the router: remote prefill with the KV
# shipped over each transport, or prefill on the decode worker (whose cache is then always
# deemed close enough). Each is (decode worker args, router args).
SERVING_PATHS = {"remote-torch": ((), ("--kv-transport", "torch")),
                 "remote-grpc": ((), ("--kv-transport", "grpc")),
                 "local": (("--local-prefill-max-tokens", "100000"), ())}


@contextlib.contextmanager
def serving_path(model: str, path: str):
    """One prefill worker, one decode worker and a router set up for `path` (SERVING_PATHS);
    yields {"url", "path", "decode"}."""
    decode_args, router_args = SERVING_PATHS[path]
    with WorkerProcess("prefill", model) as p, WorkerProcess("decode", model, *decode_args) as d, \
            RouterProcess(model, [p.address], [d.address], *router_args) as router:
        yield {"url": router.url, "path": path, "decode": d}
