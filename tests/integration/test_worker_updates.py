"""Workers push their load and prefix-cache changes to routers (`Watch`), over real gRPC from
real worker processes: an update at once with the whole cache, the blocks a request stored
within an interval of its end, heartbeats while idle, the whole cache again for a cursor the
worker does not know; and the router's registry, following those streams, takes a hung
worker (SIGSTOP) out of routing while the other workers' updates keep coming, takes it back
when it answers again, and drops a killed one at once."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from pdserve.engine.block_hash import prefix_hashes
from pdserve.engine.cache_events import key64
from pdserve.protos import pdserve_pb2 as pb
from pdserve.router.registry import HEARTBEAT_S, SILENT_AFTER_S, WorkerRegistry, static_source
from pdserve.testkit.workers import SECURITY, WorkerProcess, collect, decode_stub, generate_request

LOCAL = ("--local-prefill-max-tokens", "4096")  # the decode worker prefills itself: no prefill worker needed
PROMPT = list(range(11, 11 + 70))


@pytest.fixture(scope="module")
def decode_pair(tiny_llama_dir):
    with WorkerProcess("decode", str(tiny_llama_dir), *LOCAL) as a, \
            WorkerProcess("decode", str(tiny_llama_dir), *LOCAL) as b:
        yield a, b


async def _next(stream) -> tuple[float, pb.WorkerUpdate]:
    update = await asyncio.wait_for(stream.read(), 10)
    return time.monotonic(), update


def test_a_worker_pushes_its_cache_at_once_then_a_requests_blocks_and_heartbeats(decode_pair):
    worker = decode_pair[0]

    async def scenario():
        channel, stub = decode_stub(worker.address)
        async with channel:
            info = await stub.Info(pb.InfoRequest())
            stream = stub.Watch(pb.WatchRequest(interval_ms=50, heartbeat_ms=200))
            _, first = await _next(stream)
            # the whole cache (from cursor 0: a reset, or every event since the worker started)
            assert first.seq == 1 and first.HasField("cache") and first.cache.since == 0
            assert first.stats.worker_id == info.worker_id
            cursor = first.cache.next_cursor
            await collect(stub, generate_request("pushed", PROMPT, 4, []))
            keys = {key64(h) for h in prefix_hashes(PROMPT[:-1], info.layout.block_size, info.cache_root)}
            stored, seq, times = set(), first.seq, []
            while not keys <= stored:  # the prompt's full blocks, reported as stored
                at, update = await _next(stream)
                assert update.seq == seq + 1  # numbered, none skipped
                seq = update.seq
                if update.HasField("cache"):
                    assert not update.cache.reset and update.cache.since == cursor  # follows what was sent
                    cursor = update.cache.next_cursor
                    stored |= set(update.cache.stored)
            for _ in range(4):  # idle now: heartbeats
                times.append((await _next(stream))[0])
            stream.cancel()
            return [b - a for a, b in zip(times, times[1:], strict=False)]

    gaps = asyncio.run(scenario())
    assert all(0.1 < gap < 2.0 for gap in gaps), gaps  # heartbeat asked: 0.2 s


def test_a_cursor_the_worker_does_not_know_gets_the_whole_cache(decode_pair):
    worker = decode_pair[0]

    async def scenario():
        channel, stub = decode_stub(worker.address)
        async with channel:
            await collect(stub, generate_request("cached", PROMPT, 2, []))
            stream = stub.Watch(pb.WatchRequest(cursor=10**12))
            _, update = await _next(stream)
            stream.cancel()
            info = await stub.Info(pb.InfoRequest())
            return update, info

    update, info = asyncio.run(scenario())
    keys = {key64(h) for h in prefix_hashes(PROMPT[:-1], info.layout.block_size, info.cache_root)}
    assert update.cache.reset and update.cache.since == 0 and keys <= set(update.cache.stored)


def test_the_registry_takes_a_hung_worker_out_of_routing_and_back_without_delaying_others(decode_pair):
    hung, other = decode_pair

    async def scenario():
        registry = WorkerRegistry(static_source([], [hung.address, other.address], SECURITY), SECURITY)
        await registry.start()
        try:
            views = {v.address: v for v in registry.workers("decode", routable=False)}
            while not all(v.stats is not None and v.routable for v in views.values()):
                await asyncio.sleep(0.02)
            os.kill(hung.proc.pid, signal.SIGSTOP)
            stopped, others_heard, left = time.monotonic(), [], None
            try:
                while time.monotonic() - stopped < SILENT_AFTER_S + 3:
                    others_heard.append(views[other.address].heard_at)
                    assert views[other.address].routable, "the other worker left routing"
                    if left is None and not views[hung.address].routable:
                        left = time.monotonic() - stopped
                    await asyncio.sleep(0.02)
            finally:
                os.kill(hung.proc.pid, signal.SIGCONT)
            resumed = time.monotonic()
            while not views[hung.address].routable:
                assert time.monotonic() - resumed < 10, "the hung worker never came back"
                await asyncio.sleep(0.02)
            return left, sorted(set(others_heard))
        finally:
            await registry.stop()

    left, heard = asyncio.run(scenario())
    assert left is not None and left <= SILENT_AFTER_S + 1.0, left
    gaps = [b - a for a, b in zip(heard, heard[1:], strict=False)]
    assert len(heard) >= 3 and max(gaps) < SILENT_AFTER_S, gaps  # the others' updates went on (~HEARTBEAT_S)
    assert HEARTBEAT_S < SILENT_AFTER_S


def test_the_registry_drops_a_killed_worker_at_once(tiny_llama_dir):
    with WorkerProcess("decode", str(tiny_llama_dir), *LOCAL) as victim:
        async def scenario():
            registry = WorkerRegistry(static_source([], [victim.address], SECURITY), SECURITY)
            await registry.start()
            try:
                [view] = registry.workers("decode", routable=False)
                while view.stats is None:
                    await asyncio.sleep(0.02)
                victim.kill()
                killed = time.monotonic()
                while view.routable:
                    assert time.monotonic() - killed < SILENT_AFTER_S, "a killed worker stayed routable"
                    await asyncio.sleep(0.005)
                return time.monotonic() - killed, view
            finally:
                await registry.stop()

        seconds, view = asyncio.run(scenario())
        assert view.unhealthy_until > 0  # out because its stream broke, not by its silence
        print(f"killed worker left routing after {seconds * 1e3:.0f} ms")
