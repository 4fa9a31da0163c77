"""The grpc KV sender (one per Prefill stream) never blocks its caller, the prefill worker's
engine thread, past `send_deadline_s` when the stream is not being read."""

import asyncio
import threading

import pytest
import torch

from pdserve.kv_transfer.grpc_transport import GrpcStreamSender
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.reservations import TransferError

LAYOUT = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")


def test_a_stream_nobody_reads_fails_the_send_after_the_deadline():
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    try:
        sender = GrpcStreamSender(loop, LAYOUT, lambda *fields: fields, max_inflight=3, send_deadline_s=0.5)
        kv = torch.randn(4, 2, 8)
        for _ in range(3):  # the window in flight
            sender.send(1, 0, 0, kv, kv)
        with pytest.raises(TransferError, match="not reading.*kv_send_deadline_s"):
            sender.send(1, 1, 0, kv, kv)

        async def drain_one():
            return await anext(aiter(sender.messages()))

        assert asyncio.run_coroutine_threadsafe(drain_one(), loop).result(10)[:3] == (1, 0, 0)
        sender.send(1, 1, 0, kv, kv)  # read again: there is room again
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(10)
        loop.close()
