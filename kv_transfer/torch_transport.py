"""KV transport `torch`: torch.distributed point-to-point, NCCL for CUDA caches, gloo on CPU.

A torch.distributed world cannot admit late joiners, so there is no global world: each
(prefill, decode) pair gets its own 2-rank process group (decode rank 0, prefill rank 1),
rendezvousing through a TCPStore the decode worker hosts, the first time the pair talks.
Pools can therefore grow and shrink at run time.

Wire protocol on a pair, prefill -> decode only: a header (int64 `[transfer_id, layer,
token_start, num_tokens, payload_elements]`) then the payload (K then V of those tokens
of that layer). Both ends move data through preallocated staging buffers. A header that
announces more than the receiver's staging capacity breaks the pair (the stream cannot be
resynchronised); any other bad piece fails only its own transfer.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import queue
import threading
from collections import defaultdict

import torch
import torch.distributed as dist

from kv_transfer.base import KVSender, KVTransportError, thread_safe_notifier
from kv_transfer.layout import KVLayout, serial_copy
from kv_transfer.reservations import ReservationTable, TransferError

logger = logging.getLogger(__name__)
_HEADER_LEN = 5
_TAG = 0
_GOODBYE = -1  # header transfer id that ends a pair cleanly


def _make_group(store, rank: int, device: torch.device, timeout_s: float):
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    return dist.ProcessGroupGloo(store, rank, 2, timeout)


def _abort(group) -> None:
    """Abort a process group: wakes blocked operations and lets the process exit cleanly."""
    if group is None:
        return
    try:
        group.abort()
    except Exception:  # noqa: BLE001 - already broken or unsupported: nothing more to do
        pass


class TorchTransport:
    """One per worker process; `listen`/`accept` on decode workers, `connect` on prefill."""

    def __init__(self, worker_id: str, layout: KVLayout, device: torch.device,
                 max_piece_tokens: int, host: str = "127.0.0.1", timeout_s: float = 30.0,
                 num_staging_buffers: int = 4) -> None:
        self.worker_id, self.layout, self.device = worker_id, layout, torch.device(device)
        self.host, self.timeout_s = host, timeout_s
        self.capacity = max_piece_tokens * layout.token_elements
        self.max_piece_tokens = max_piece_tokens
        self.num_staging_buffers = num_staging_buffers
        self._lock = threading.Lock()
        self._store = None
        self._table: ReservationTable | None = None
        self._receivers: dict[str, _PairReceiver] = {}
        self._generation: dict[str, int] = defaultdict(int)
        self._senders: dict[str, TorchPairSender] = {}
        self._connecting: dict[str, threading.Lock] = {}

    # ------------------------------------------------------------ decode side
    def listen(self, table: ReservationTable) -> str:
        """Host the rendezvous store; returns its `host:port`."""
        self._table = table
        self._store = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=self.timeout_s))
        return f"{self.host}:{self._store.port}"

    def accept(self, peer_id: str) -> str:
        """Make sure a pair with prefill worker `peer_id` is forming or formed; returns the
        endpoint to give that worker. Non-blocking."""
        if self._store is None or self._table is None:
            raise KVTransportError("listen() must be called before accept()")
        with self._lock:
            receiver = self._receivers.get(peer_id)
            if receiver is None or receiver.broken:
                self._generation[peer_id] += 1
                prefix = f"{peer_id}/{self._generation[peer_id]}"
                store = dist.PrefixStore(prefix, self._store)
                receiver = _PairReceiver(peer_id, prefix, store, self)
                self._receivers[peer_id] = receiver
                receiver.start()
            return f"{self.host}:{self._store.port}/{receiver.prefix}"

    def wait_closed(self, peer_id: str, timeout_s: float = 10.0) -> None:
        """Wait for the pair with `peer_id` to end (after the sender closed it)."""
        receiver = self._receivers.get(peer_id)
        if receiver is not None:
            receiver.join(timeout_s)

    # ------------------------------------------------------------ prefill side
    def connect(self, endpoint: str) -> TorchPairSender:
        """Join the pair named by `endpoint` (blocking until the group forms). Concurrent
        callers for one endpoint share one group."""
        with self._lock:
            endpoint_lock = self._connecting.setdefault(endpoint, threading.Lock())
        with endpoint_lock:
            with self._lock:
                sender = self._senders.get(endpoint)
            if sender is not None and not sender.broken:
                return sender
            return self._join(endpoint)

    def _join(self, endpoint: str) -> TorchPairSender:
        address, _, prefix = endpoint.partition("/")
        host, _, port = address.rpartition(":")
        if not prefix or not port.isdigit():
            raise KVTransportError(f"malformed torch KV endpoint {endpoint!r}")
        try:
            store = dist.TCPStore(host, int(port), is_master=False,
                                  timeout=datetime.timedelta(seconds=self.timeout_s))
            group = _make_group(dist.PrefixStore(prefix, store), 1, self.device, self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - any rendezvous failure
            raise KVTransportError(f"cannot join KV pair at {endpoint}: {exc}") from exc
        sender = TorchPairSender(group, store, self)
        with self._lock:
            self._senders[endpoint] = sender
        return sender

    def close(self) -> None:
        """Stop every pair (aborting blocked sends/receives) so the process can exit cleanly."""
        for sender in list(self._senders.values()):
            sender.close()
        for receiver in list(self._receivers.values()):
            receiver.close()


class _PairReceiver(threading.Thread):
    """Decode side of one pair: forms the group, then receives pieces until it breaks.

    Receiving and writing into the cache overlap: this thread receives into one staging
    buffer while a writer thread validates and copies the previous one into the cache.
    """

    def __init__(self, peer_id: str, prefix: str, store, transport: TorchTransport) -> None:
        super().__init__(name=f"kv-recv-{peer_id[:8]}", daemon=True)
        self.peer_id, self.prefix, self.store, self.transport = peer_id, prefix, store, transport
        self.broken = False
        self.group = None
        self._free: queue.Queue = queue.Queue()
        self._received: queue.Queue = queue.Queue()

    def close(self) -> None:
        self.broken = True
        _abort(self.group)

    def run(self) -> None:
        t = self.transport
        writer = threading.Thread(target=self._write_loop, name=f"kv-write-{self.peer_id[:8]}", daemon=True)
        try:
            group = self.group = _make_group(self.store, 0, t.device, t.timeout_s)
            header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=t.device)
            for _ in range(2):
                self._free.put(torch.empty(t.capacity, dtype=t.layout.torch_dtype, device=t.device))
            writer.start()
            while not self.broken:
                staging = self._free.get()
                group.recv([header], 1, _TAG).wait()
                transfer_id, layer, start, count, numel = header.tolist()
                if transfer_id == _GOODBYE:
                    break
                if not 0 <= numel <= t.capacity:
                    raise KVTransportError(f"peer announced {numel} elements; staging holds {t.capacity}")
                group.recv([staging[:numel]], 1, _TAG).wait()
                self._received.put((transfer_id, layer, start, count, staging, numel))
        except Exception as exc:  # noqa: BLE001 - the pair is unusable from here on
            if not self.broken:
                logger.warning("KV pair with %s broke: %s", self.peer_id, exc)
            self.broken = True
            t._table.fail_peer(self.peer_id, f"KV connection to prefill worker lost: {exc}")
        finally:
            self.broken = True
            self._received.put(None)
            if writer.is_alive():
                writer.join(5)

    def _write_loop(self) -> None:
        table = self.transport._table
        while (item := self._received.get()) is not None:
            transfer_id, layer, start, count, staging, numel = item
            try:
                table.write(transfer_id, layer, start, count, staging[:numel], peer=self.peer_id)
            except TransferError as exc:
                logger.warning("rejected KV piece from %s: %s", self.peer_id, exc)
                table.fail(transfer_id, str(exc))
            finally:
                self._free.put(staging)


class TorchPairSender(KVSender):
    """Prefill side of one pair: a staging pool and a thread that puts pieces on the wire."""

    def __init__(self, group, store, transport: TorchTransport) -> None:
        self.group, self.store, self.transport = group, store, transport
        self.broken: str | None = None
        t = transport
        self._free = queue.Queue()
        for _ in range(t.num_staging_buffers):
            self._free.put(torch.empty(t.capacity, dtype=t.layout.torch_dtype, device=t.device))
        self._outbox: queue.Queue = queue.Queue()
        self._cond = threading.Condition()
        self._pending: dict[int, int] = defaultdict(int)
        self._waiters: dict[int, list] = defaultdict(list)
        self._discarded: set[int] = set()
        self._thread = threading.Thread(target=self._run, name="kv-send", daemon=True)
        self._thread.start()

    def send(self, transfer_id, layer, token_start, k, v) -> None:
        step = self.transport.max_piece_tokens
        for offset in range(0, k.shape[0], step):
            self._send_piece(transfer_id, layer, token_start + offset,
                             k[offset : offset + step], v[offset : offset + step])

    def _send_piece(self, transfer_id, layer, token_start, k, v) -> None:
        if self.broken:
            raise TransferError(f"KV pair broken: {self.broken}")
        buffer = self._take_buffer()
        count = k.shape[0]
        numel = 2 * k.numel()
        copy = serial_copy if buffer.device.type == "cpu" else torch.Tensor.copy_
        copy(buffer[: k.numel()].view(k.shape), k)
        copy(buffer[k.numel() : numel].view(v.shape), v)
        with self._cond:
            self._pending[transfer_id] += 1
        self._outbox.put((transfer_id, layer, token_start, count, numel, buffer))

    def _take_buffer(self) -> torch.Tensor:
        while True:  # back-pressure: wait for a staging buffer, unless the pair broke
            try:
                return self._free.get(timeout=0.5)
            except queue.Empty:
                if self.broken:
                    raise TransferError(f"KV pair broken: {self.broken}") from None

    def _run(self) -> None:
        device = self.transport.device
        header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=device)
        while True:
            item = self._outbox.get()
            if item is None:
                return
            transfer_id, layer, start, count, numel, buffer = item
            if transfer_id == _GOODBYE:
                self._send_goodbye(header)
                continue
            try:
                if transfer_id not in self._discarded and not self.broken:
                    header.copy_(torch.tensor([transfer_id, layer, start, count, numel]))
                    self.group.send([header], 0, _TAG).wait()
                    self.group.send([buffer[:numel]], 0, _TAG).wait()
                    if device.type == "cuda":
                        torch.cuda.current_stream(device).synchronize()
            except Exception as exc:  # noqa: BLE001 - the peer is gone
                logger.warning("KV send failed: %s", exc)
                self.broken = str(exc)
            finally:
                self._free.put(buffer)
                self._done_one(transfer_id)

    def _send_goodbye(self, header: torch.Tensor) -> None:
        try:
            header.copy_(torch.tensor([_GOODBYE, 0, 0, 0, 0]))
            self.group.send([header], 0, _TAG).wait()
        except Exception:  # noqa: BLE001 - the peer is gone already
            pass

    def _done_one(self, transfer_id: int) -> None:
        with self._cond:
            self._pending[transfer_id] -= 1
            if self._pending[transfer_id] > 0:
                return
            del self._pending[transfer_id]
            self._discarded.discard(transfer_id)
            waiters = self._waiters.pop(transfer_id, [])
        for notify in waiters:
            notify()

    async def flush(self, transfer_id: int) -> None:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._cond:
            if self._pending.get(transfer_id, 0) > 0:
                self._waiters[transfer_id].append(thread_safe_notifier(loop, future))
            else:
                future.set_result(None)
        await future
        if self.broken:
            raise TransferError(f"KV pair broken: {self.broken}")

    def discard(self, transfer_id: int) -> None:
        with self._cond:
            if self._pending.get(transfer_id, 0) > 0:
                self._discarded.add(transfer_id)

    def close(self) -> None:
        """Say goodbye (the peer's receiver ends cleanly), stop the sending thread."""
        if not self.broken:
            self._outbox.put((_GOODBYE, 0, 0, 0, 0, None))
        self._outbox.put(None)
        self._thread.join(5)
        self.broken = self.broken or "closed"
