"""KV transport `torch`: torch.distributed point-to-point, NCCL for CUDA caches, gloo on CPU.

A torch.distributed world cannot admit late joiners, so there is no global world: each
(prefill, decode) pair gets its own 2-rank process group (decode rank 0, prefill rank 1),
rendezvousing through a TCPStore the decode worker hosts, the first time the pair talks.
Pools can therefore grow and shrink at run time.

Wire protocol on a pair, prefill -> decode only: one message per piece, a 40-byte header
(int64 `[transfer_id, layer, token_start, num_tokens, payload_elements]`) followed by the
payload (K then V of those tokens of that layer). One message rather than a header message
and a payload message: every gloo message costs a rendezvous, and on loopback that was a
third of the time per piece. The receiver posts a staging buffer of its full capacity
(gloo accepts shorter messages; NCCL needs exact sizes, so on CUDA the header and the
payload go as two messages, same buffer layout); the endpoint it hands out names that capacity in tokens,
and senders cut pieces to fit. A header that announces more than the capacity breaks the
pair (the stream cannot be resynchronised); any other bad piece fails only its own
transfer. The receiver writes each piece into the cache on its receiving thread: on a
2-core machine a second writer thread only added contention (measured: 1.6 GB/s with it).
Two more designs were measured on that machine and not kept, because both processes'
copies and gloo's event loops already keep both cores busy and each design cost CPU: posting
the next receive before writing the current piece (gloo sends only into a posted buffer) took
60-90 ms of CPU per 94 MB instead of ~50; sending from the caller's thread without the
sending thread was no faster.

A pair lives as long as both processes do: the receiver waits for the next piece without the
group's timeout (a soak run found idle pairs breaking after 60 s and being formed anew). When
a decode worker hands out a new endpoint for a prefill worker anyway (its side of the old
pair broke), the prefill side retires its sender for the old one on joining the new one, so
nothing is left behind (the same soak found each re-formed pair leaking 4 threads and ~5 fds
on the prefill worker).

A decode worker that stops reading (hung, not dead) must not stall the prefill worker's engine
thread, which copies pieces into the staging pool: a piece that finds no free staging buffer
for `send_deadline_s` fails its transfer (`TransferError`), and until the pair's sending thread
gets a piece onto the wire again every later piece for that pair fails at once. Only the
requests shipping to that peer fail; a broken pair's sender or receiver leaves the transport's
tables (a peer that went away leaves nothing behind).

Trust: a pair forms only under a random one-time key that the decode worker hands out inside
an authenticated Prefill RPC (see `accept`). gloo ends the receiving process if a message
exceeds the posted buffer, so the peer that holds the key must be a worker of this deployment
(they honour the advertised capacity); the grpc transport validates every byte.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import logging
import os
import queue
import secrets
import socket
import threading
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from pdserve.kv_transfer.base import KVSender, KVTransport, KVTransportError, TransportSettings, thread_safe_notifier
from pdserve.kv_transfer.layout import KVLayout, host_copy
from pdserve.kv_transfer.reservations import ReservationTable, TransferError

logger = logging.getLogger(__name__)
_HEADER_LEN = 5
_HEADER_BYTES = 8 * _HEADER_LEN
_TAG = 0
_GOODBYE = -1  # header transfer id that ends a pair cleanly
# How long an idle pair's receiver waits for the next piece. Not the group's timeout (which
# bounds the rendezvous): an idle pair is healthy, and a peer that dies closes its sockets,
# which ends the wait at once.
_IDLE_WAIT = datetime.timedelta(days=1)


def _make_group(store, rank: int, device: torch.device, timeout_s: float, host: str):
    """The pair's two-rank group. Gloo binds to `host`, the worker's own address, so pairs
    between nodes need no GLOO_SOCKET_IFNAME (which, when set, still wins)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    if os.environ.get("GLOO_SOCKET_IFNAME") or host in ("", "0.0.0.0", "::"):
        return dist.ProcessGroupGloo(store, rank, 2, timeout)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, 2, options)


def _abort(group) -> None:
    """Abort a process group: wakes blocked operations and lets the process exit cleanly."""
    if group is None:
        return
    try:
        group.abort()
    except Exception:  # noqa: BLE001 - already broken or unsupported: nothing more to do
        pass


def _store_listening_on(host: str, timeout_s: float):
    """A master TCPStore that listens on `host` only: TCPStore binds every interface when it
    opens its own socket, so it gets one already bound (it takes over the descriptor)."""
    family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, 0))
        store = dist.TCPStore(host, listener.getsockname()[1], is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s), master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()
    return store


class TorchTransport(KVTransport):
    """One per worker process; `listen`/`accept` on decode workers, `connect` on prefill."""

    name = "torch"

    def __init__(self, worker_id: str, layout: KVLayout, device: torch.device,
                 max_piece_tokens: int, host: str = "127.0.0.1", timeout_s: float = 30.0,
                 num_staging_buffers: int = 4, send_deadline_s: float = 5.0) -> None:
        self.worker_id, self.layout, self.device = worker_id, layout, torch.device(device)
        self.host, self.timeout_s, self.send_deadline_s = host, timeout_s, send_deadline_s
        self.capacity = max_piece_tokens * layout.token_elements
        self.max_piece_tokens = max_piece_tokens
        self.num_staging_buffers = num_staging_buffers
        self._lock = threading.Lock()
        self._store = None
        self._table: ReservationTable | None = None
        self._receivers: dict[str, _PairReceiver] = {}
        self._pair_numbers = itertools.count(1)
        self._senders: dict[str, TorchPairSender] = {}
        self._connecting: dict[str, threading.Lock] = {}

    @classmethod
    def from_settings(cls, settings: TransportSettings) -> TorchTransport:
        return cls(settings.worker_id, settings.layout, settings.device, max_piece_tokens=settings.max_piece_tokens,
                   host=settings.host, timeout_s=settings.timeout_s, send_deadline_s=settings.send_deadline_s)

    # ------------------------------------------------------------ decode side
    def listen(self, table: ReservationTable) -> str:
        """Host the rendezvous store; returns its `host:port`."""
        self._table = table
        self._store = _store_listening_on(self.host, self.timeout_s)
        return f"{self.host}:{self._store.port}"

    def accept(self, peer_id: str) -> str:
        """Make sure a pair with prefill worker `peer_id` is forming or formed; returns the
        endpoint to give that worker (`host:port/prefix?piece_tokens=N`). Non-blocking.

        The prefix holds a one-time random pair key. It travels only inside the Prefill RPC,
        which the cluster token authenticates, so a stranger who reaches the store cannot
        find the pair's keys, join its group, or make this worker allocate staging for it."""
        if self._store is None or self._table is None:
            raise KVTransportError("listen() must be called before accept()")
        with self._lock:
            receiver = self._receivers.get(peer_id)
            if receiver is None or receiver.broken:
                prefix = f"{peer_id}/{next(self._pair_numbers)}/{secrets.token_hex(16)}"
                receiver = _PairReceiver(peer_id, prefix, self)
                self._receivers[peer_id] = receiver
                receiver.start()
            return f"{self.host}:{self._store.port}/{receiver.prefix}?piece_tokens={self.max_piece_tokens}"

    def endpoint_for(self, peer_id: str) -> str:
        """`accept`: the pair's endpoint, handed to the prefill worker inside its Prefill RPC."""
        return self.accept(peer_id)

    def writer_for(self, peer_id: str) -> str:
        """Pieces arrive tagged with their pair's peer: only `peer_id` may write the leg's blocks."""
        return peer_id

    def wait_closed(self, peer_id: str, timeout_s: float = 10.0) -> None:
        """Wait for the pair with `peer_id` to end (after the sender closed it)."""
        receiver = self._receivers.get(peer_id)
        if receiver is not None:
            receiver.join(timeout_s)

    # ------------------------------------------------------------ prefill side
    def check_endpoint(self, endpoint: str) -> None:
        if not endpoint:
            raise ValueError("kv_endpoint is required for the torch transport")

    async def open_sender(self, endpoint: str) -> TorchPairSender:
        """`connect`, off the event loop."""
        return await asyncio.to_thread(self.connect, endpoint)

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
        rest, _, query = endpoint.partition("?piece_tokens=")
        address, _, prefix = rest.partition("/")
        host, _, port = address.rpartition(":")
        if not prefix or not port.isdigit() or not query.isdigit() or int(query) < 1:
            raise KVTransportError(f"malformed torch KV endpoint {address!r}/... "
                                   "(expected host:port/prefix?piece_tokens=N)")
        try:
            store = dist.TCPStore(host, int(port), is_master=False,
                                  timeout=datetime.timedelta(seconds=self.timeout_s))
            group = _make_group(dist.PrefixStore(prefix, store), 1, self.device, self.timeout_s, self.host)
        except Exception as exc:  # noqa: BLE001 - any rendezvous failure
            raise KVTransportError(f"cannot join KV pair at {address}: {exc}") from exc
        sender = TorchPairSender(group, store, self, min(self.max_piece_tokens, int(query)), endpoint)
        with self._lock:
            self._senders[endpoint] = sender
            # the decode worker at `address` handed out a new pair: its side of any older one is gone
            superseded = [s for e, s in self._senders.items() if e != endpoint and e.partition("/")[0] == address]
        for old in superseded:
            old.retire("superseded by a new pair with the same decode worker")
        return sender

    def _forget(self, pair) -> None:
        """Drop a broken pair's entries (called by the pair itself)."""
        with self._lock:
            if isinstance(pair, TorchPairSender) and self._senders.get(pair.endpoint) is pair:
                del self._senders[pair.endpoint]
                self._connecting.pop(pair.endpoint, None)
            if isinstance(pair, _PairReceiver) and self._receivers.get(pair.peer_id) is pair:
                del self._receivers[pair.peer_id]

    def close(self) -> None:
        """Stop every pair (aborting blocked sends/receives) so the process can exit cleanly."""
        for sender in list(self._senders.values()):
            sender.close()
        for receiver in list(self._receivers.values()):
            receiver.close()


class _PairReceiver(threading.Thread):
    """Decode side of one pair: forms the group, then receives pieces until it breaks."""

    def __init__(self, peer_id: str, prefix: str, transport: TorchTransport) -> None:
        super().__init__(name=f"kv-recv-{peer_id[:8]}", daemon=True)
        self.peer_id, self.prefix, self.transport = peer_id, prefix, transport
        self.store = None
        self.broken = False
        self.group = None

    def close(self) -> None:
        self.broken = True
        _abort(self.group)

    def run(self) -> None:
        t = self.transport
        table = t._table
        try:
            # a store client of its own: on one shared client, a pair whose peer never comes
            # would hold the client's lock in its blocking wait, stalling every other pair's
            # rendezvous until it timed out
            self.store = dist.TCPStore(t.host, t._store.port, is_master=False,
                                       timeout=datetime.timedelta(seconds=t.timeout_s))
            group = self.group = _make_group(dist.PrefixStore(self.prefix, self.store), 0, t.device, t.timeout_s,
                                              t.host)
            message = _message_buffer(t.capacity, t.layout.torch_dtype, t.device)
            header, payload = _split(message, t.layout.torch_dtype)
            exact_sizes = t.device.type == "cuda"
            while not self.broken:
                group.recv([message[:_HEADER_BYTES] if exact_sizes else message], 1, _TAG).wait(_IDLE_WAIT)
                transfer_id, layer, start, count, numel = header.tolist()
                if transfer_id == _GOODBYE:
                    break
                if not 0 <= numel <= t.capacity:
                    raise KVTransportError(f"peer announced {numel} elements; staging holds {t.capacity}")
                if exact_sizes:
                    group.recv([payload[:numel].view(torch.uint8)], 1, _TAG).wait()
                try:
                    table.write(transfer_id, layer, start, count, payload[:numel], peer=self.peer_id)
                except TransferError as exc:
                    logger.warning("rejected KV piece from %s: %s", self.peer_id, exc)
                    table.fail(transfer_id, str(exc))
        except Exception as exc:  # noqa: BLE001 - the pair is unusable from here on
            if not self.broken:
                logger.warning("KV pair with %s broke: %s", self.peer_id, exc)
            self.broken = True
            table.fail_peer(self.peer_id, f"KV connection to prefill worker lost: {exc}")
        finally:
            self.broken = True
            t._forget(self)


def _message_buffer(capacity: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A byte buffer for one message: the header, then up to `capacity` elements."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return torch.empty(_HEADER_BYTES + capacity * element_size, dtype=torch.uint8, device=device)


def _split(message: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a message buffer: the int64 header and the payload elements."""
    return message[:_HEADER_BYTES].view(torch.int64), message[_HEADER_BYTES:].view(dtype)


class TorchPairSender(KVSender):
    """Prefill side of one pair: a staging pool and a thread that puts pieces on the wire.
    Pieces are at most `piece_tokens` tokens (the receiver's capacity, or ours if smaller)."""

    def __init__(self, group, store, transport: TorchTransport, piece_tokens: int, endpoint: str = "") -> None:
        self.group, self.store, self.transport = group, store, transport
        self.piece_tokens, self.endpoint = piece_tokens, endpoint
        self.broken: str | None = None
        self._stalled: str | None = None  # why pieces fail at once until one goes on the wire again
        t = transport
        capacity = piece_tokens * t.layout.token_elements
        self._free = queue.Queue()
        for _ in range(t.num_staging_buffers):
            self._free.put(_message_buffer(capacity, t.layout.torch_dtype, t.device))
        self._outbox: queue.Queue = queue.Queue()
        self._cond = threading.Condition()
        self._pending: dict[int, int] = defaultdict(int)
        self._waiters: dict[int, list] = defaultdict(list)
        self._discarded: set[int] = set()
        self._thread = threading.Thread(target=self._run, name="kv-send", daemon=True)
        self._thread.start()

    def send(self, transfer_id, layer, token_start, k, v) -> None:
        step = self.piece_tokens
        for offset in range(0, k.shape[0], step):
            self._send_piece(transfer_id, layer, token_start + offset,
                             k[offset : offset + step], v[offset : offset + step])

    def _send_piece(self, transfer_id, layer, token_start, k, v) -> None:
        if self.broken:
            raise TransferError(f"KV pair broken: {self.broken}")
        message = self._take_buffer()
        header, payload = _split(message, self.transport.layout.torch_dtype)
        count = k.shape[0]
        numel = 2 * k.numel()
        copy = host_copy if message.device.type == "cpu" else torch.Tensor.copy_
        copy(payload[: k.numel()].view(k.shape), k)
        copy(payload[k.numel() : numel].view(v.shape), v)
        header.copy_(torch.tensor([transfer_id, layer, token_start, count, numel]))
        size = _HEADER_BYTES + numel * payload.element_size()
        with self._cond:
            self._pending[transfer_id] += 1
        self._outbox.put((transfer_id, message, size))

    def _take_buffer(self) -> torch.Tensor:
        """A free staging buffer: back-pressure, but for at most `send_deadline_s`."""
        if self._stalled:
            raise TransferError(self._stalled)
        deadline_s = self.transport.send_deadline_s
        deadline = time.monotonic() + deadline_s
        while True:
            try:
                return self._free.get(timeout=max(0.0, min(0.5, deadline - time.monotonic())))
            except queue.Empty:
                if self.broken:
                    raise TransferError(f"KV pair broken: {self.broken}") from None
                if time.monotonic() >= deadline:
                    self._stalled = (f"KV peer is not reading: no piece went on the wire to it in "
                                     f"{deadline_s:g} s (kv_send_deadline_s)")
                    raise TransferError(self._stalled) from None

    def _run(self) -> None:
        device = self.transport.device
        while True:
            item = self._outbox.get()
            if item is None:
                return
            transfer_id, message, size = item
            if transfer_id == _GOODBYE:
                self._send_goodbye()
                continue
            try:
                if transfer_id not in self._discarded and not self.broken:
                    if device.type == "cuda":  # NCCL needs exact sizes: header, then payload
                        self.group.send([message[:_HEADER_BYTES]], 0, _TAG).wait()
                        self.group.send([message[_HEADER_BYTES:size]], 0, _TAG).wait()
                        torch.cuda.current_stream(device).synchronize()  # before reuse
                    else:
                        self.group.send([message[:size]], 0, _TAG).wait()
                    self._stalled = None
            except Exception as exc:  # noqa: BLE001 - the peer is gone
                logger.warning("KV send failed: %s", exc)
                self.broken = str(exc)
            finally:
                self._free.put(message)
                self._done_one(transfer_id)
            if self.broken:
                self._end_broken()
                return

    def _end_broken(self) -> None:
        """After the pair broke: account for the pieces still queued, wake every flush (they
        raise), leave the transport's table, release the group. The thread then ends."""
        while True:
            try:
                item = self._outbox.get_nowait()
            except queue.Empty:
                break
            if item is not None and item[0] != _GOODBYE:
                self._free.put(item[1])
                self._done_one(item[0])
        with self._cond:
            waiters = [notify for notifies in self._waiters.values() for notify in notifies]
            self._waiters.clear()
        for notify in waiters:
            notify()
        self.transport._forget(self)
        _abort(self.group)

    def _send_goodbye(self) -> None:
        try:
            header = torch.tensor([_GOODBYE, 0, 0, 0, 0], dtype=torch.int64, device=self.transport.device)
            self.group.send([header.view(torch.uint8)], 0, _TAG).wait()
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
            if self.broken:
                raise TransferError(f"KV pair broken: {self.broken}")
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

    def finish(self) -> None:
        """Nothing to end: the pair outlives the leg (`flush` waits for the leg's pieces)."""

    async def messages(self):
        """None: the pieces go over the pair, not the Prefill stream."""
        return
        yield

    def retire(self, why: str) -> None:
        """End a pair whose receiver is gone: no goodbye (nobody would read it); the sending
        thread fails what is queued and ends; the pair leaves the transport's table."""
        self.broken = self.broken or why
        self._outbox.put(None)
        self.transport._forget(self)

    def close(self) -> None:
        """Say goodbye (the peer's receiver ends cleanly), stop the sending thread."""
        if not self.broken:
            self._outbox.put((_GOODBYE, None, 0))
        self._outbox.put(None)
        self._thread.join(5)
        self.broken = self.broken or "closed"
