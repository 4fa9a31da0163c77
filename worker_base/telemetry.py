"""What a worker counts about itself for the operators, and how it goes into its Stats.

Workers do not serve Prometheus themselves: they report these in the `Stats` report they
already push to the router for load and health (`Watch`), and the router exports them per worker
(`router.metrics`). One scrape target per deployment, no port per worker to open or secure
(worker RPCs need the cluster token), and the router's view is what routing used.

KV transfers are counted per (transport, direction): bytes, seconds per transfer (from its
first KV piece to its last, which overlaps the prefill computing the later layers), and
failures by reason.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from pdserve.engine.stats import Histogram
from pdserve.kv_transfer.reservations import TransferError
from pdserve.protos import pdserve_pb2 as pb

TRANSFER_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


def histogram_to_proto(histogram: Histogram, message: pb.Histogram) -> None:
    message.bounds[:] = histogram.bounds
    message.counts[:] = histogram.counts
    message.sum = histogram.sum


class TransferCounters:
    """This worker's KV transfers, per (transport, direction)."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, str], tuple[list[int], Histogram, dict[str, int]]] = {}

    def _entry(self, transport: str, direction: str):
        key = (transport, direction)
        if key not in self._by_key:
            self._by_key[key] = ([0], Histogram(TRANSFER_SECONDS_BUCKETS), {})
        return self._by_key[key]

    def succeeded(self, transport: str, direction: str, num_bytes: int, seconds: float | None) -> None:
        """A transfer of `num_bytes` done; `seconds` None when no piece moved (all cached)."""
        moved, histogram, _ = self._entry(transport, direction)
        moved[0] += num_bytes
        if seconds is not None:
            histogram.observe(seconds)

    def failed(self, transport: str, direction: str, reason: str) -> None:
        failures = self._entry(transport, direction)[2]
        failures[reason] = failures.get(reason, 0) + 1

    def to_proto(self) -> list[pb.TransferStats]:
        out = []
        for (transport, direction), (moved, histogram, failures) in sorted(self._by_key.items()):
            message = pb.TransferStats(transport=transport, direction=direction, bytes=moved[0], failures=failures)
            histogram_to_proto(histogram, message.seconds)
            out.append(message)
        return out


def failure_reason(exc: BaseException) -> str:
    """A short label for why a transfer failed (a Prometheus label value)."""
    if isinstance(exc, asyncio.TimeoutError | TimeoutError):
        return "timeout"
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code().name.lower()
    if isinstance(exc, TransferError):
        return "bad_transfer"
    return "error"


class Stopwatch:
    """When something first happened, and how long since."""

    def __init__(self) -> None:
        self.started: float | None = None

    def start(self) -> None:
        if self.started is None:
            self.started = time.monotonic()

    def seconds(self) -> float | None:
        return None if self.started is None else time.monotonic() - self.started
