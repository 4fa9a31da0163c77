"""The torch transport's own contract, over a real gloo pair (both ends in this process):
pieces are cut to the receiver's advertised capacity, and endpoints are checked."""

import threading
import time

import pytest
import torch

from pdserve.kv_transfer.base import KVTransportError
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.reservations import ReservationTable
from pdserve.kv_transfer.torch_transport import TorchTransport

LAYOUT = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")


def connect(sender_side: TorchTransport, endpoint: str):
    holder = {}
    joiner = threading.Thread(target=lambda: holder.update(sender=sender_side.connect(endpoint)))
    joiner.start()
    joiner.join(30)
    return holder["sender"]


def ship_six_tokens(table, sender, receiver) -> None:
    """Send 6 tokens of KV from peer "p" over the pair and check they arrive; then close it."""
    try:
        res = table.register("r", [0, 1], 6, peer="p")
        kv = torch.randn(LAYOUT.num_layers, 2, 6, 2, 8)
        for layer in range(LAYOUT.num_layers):
            sender.send(res.transfer_id, layer, 0, kv[layer, 0], kv[layer, 1])
        assert res.done.wait(30) and res.complete, res.error
    finally:
        sender.close()
        receiver.wait_closed("p")
        receiver.close()


def release(receiver: TorchTransport, peer_id: str, endpoint: str) -> None:
    """End a pair whose peer never came: join it, close it, and wait for its receiver thread,
    so no thread is left in a rendezvous wait (one timing out while the interpreter exits
    aborts the process)."""
    pair = receiver._receivers[peer_id]
    connect(TorchTransport(peer_id, LAYOUT, "cpu", max_piece_tokens=8), endpoint).close()
    pair.join(30)
    assert not pair.is_alive()
    assert peer_id not in receiver._receivers, "an ended pair stays in the transport's table"


def wait_until_waiting_for_peer(endpoint: str, timeout_s: float = 30.0) -> None:
    """Until the pair named by `endpoint`, the only one started on its store, is waiting for
    its peer: its receiver has posted its half of the rendezvous (a key in the store, which
    holds nothing else) and blocks in the group's forming."""
    import datetime

    import torch.distributed as dist

    host, _, port = endpoint.partition("/")[0].rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    deadline = time.monotonic() + timeout_s
    while store.num_keys() == 0:
        assert time.monotonic() < deadline, f"the pair at {endpoint} posted no rendezvous key in {timeout_s} s"
        time.sleep(0.01)


def test_sender_cuts_pieces_to_the_receivers_capacity():
    """A prefill worker configured for bigger pieces than the decode worker can stage must
    still deliver every token intact (the endpoint tells it the receiver's capacity)."""
    blocks, tokens = 12, 45
    cache = torch.zeros(LAYOUT.num_layers, 2, blocks, LAYOUT.block_size, 2, 8)
    table = ReservationTable(LAYOUT, cache)
    receiver = TorchTransport("d", LAYOUT, "cpu", max_piece_tokens=8)
    receiver.listen(table)
    endpoint = receiver.accept("p")
    assert endpoint.endswith("?piece_tokens=8")
    sender = connect(TorchTransport("p", LAYOUT, "cpu", max_piece_tokens=64), endpoint)
    try:
        assert sender.piece_tokens == 8
        block_table = [11, 3, 4, 5, 0, 1, 2, 9, 8, 7, 6, 10]
        res = table.register("r", block_table, tokens, peer="p")
        kv = torch.randn(LAYOUT.num_layers, 2, tokens, 2, 8)
        for layer in range(LAYOUT.num_layers):
            sender.send(res.transfer_id, layer, 0, kv[layer, 0], kv[layer, 1])
        assert res.done.wait(30) and res.complete, res.error
        for layer in range(LAYOUT.num_layers):
            for half in range(2):
                flat = cache[layer, half].view(-1, 2, 8)
                assert torch.equal(flat[res.slots], kv[layer, half])
    finally:
        sender.close()
        receiver.wait_closed("p")
        receiver.close()


@pytest.mark.parametrize("endpoint", ["127.0.0.1:1/p/1", "127.0.0.1:1/p/1?piece_tokens=0", "nohost/p?piece_tokens=4"])
def test_malformed_endpoint_is_named(endpoint):
    with pytest.raises(KVTransportError, match="malformed torch KV endpoint"):
        TorchTransport("p", LAYOUT, "cpu", max_piece_tokens=8).connect(endpoint)


def test_a_stranger_without_the_pair_key_cannot_join():
    """The endpoint's prefix carries a one-time random key, given out only inside the
    authenticated Prefill RPC. A stranger who reaches the rendezvous store and knows the peer
    id and generation (but not the key) cannot form the pair; the real peer still can."""
    cache = torch.zeros(LAYOUT.num_layers, 2, 4, LAYOUT.block_size, 2, 8)
    table = ReservationTable(LAYOUT, cache)
    receiver = TorchTransport("d", LAYOUT, "cpu", max_piece_tokens=8, timeout_s=30)
    receiver.listen(table)
    endpoint = receiver.accept("p")
    address, prefix = endpoint.split("?")[0].split("/", 1)
    peer, generation, key = prefix.split("/")
    assert (peer, generation) == ("p", "1") and len(key) == 32 and int(key, 16) >= 0
    other = receiver.accept("q")
    assert other.split("?")[0].rsplit("/", 1)[1] != key  # one key per pair
    guessed = f"{address}/p/1?piece_tokens=8"
    with pytest.raises(KVTransportError, match="cannot join KV pair"):
        TorchTransport("stranger", LAYOUT, "cpu", max_piece_tokens=8, timeout_s=3).connect(guessed)
    sender = connect(TorchTransport("p", LAYOUT, "cpu", max_piece_tokens=8), endpoint)
    ship_six_tokens(table, sender, receiver)
    release(receiver, "q", other)


def test_a_pair_whose_peer_never_comes_does_not_hold_up_another():
    """The decode worker accepts pairs for several prefill workers; one that never connects
    (it died after asking) must not stall the others' rendezvous. Its wait here would last
    600 s: the other pair forms long before."""
    cache = torch.zeros(LAYOUT.num_layers, 2, 4, LAYOUT.block_size, 2, 8)
    table = ReservationTable(LAYOUT, cache)
    receiver = TorchTransport("d", LAYOUT, "cpu", max_piece_tokens=8, timeout_s=600)
    receiver.listen(table)
    never = receiver.accept("never")
    wait_until_waiting_for_peer(never)
    sender = connect(TorchTransport("p", LAYOUT, "cpu", max_piece_tokens=8), receiver.accept("p"))
    ship_six_tokens(table, sender, receiver)
    release(receiver, "never", never)


_HUNG_PEER = """
import datetime, sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=600))
print(store.port, flush=True)
group = dist.ProcessGroupGloo(dist.PrefixStore("hung/1/key", store), 0, 2, datetime.timedelta(seconds=600))
print("formed", flush=True)
time.sleep(600)  # never receives
"""


def test_a_peer_that_stops_reading_fails_pieces_after_the_deadline_and_leaves_no_pair_behind():
    """The decode end of this pair (another process) forms it and never posts a receive: a
    hung worker. The prefill side's `send`, called on its engine thread, gives up after
    `send_deadline_s` with an error naming the cause, instead of waiting out the pair's 600 s
    timeout; later pieces for that peer fail at once. When the hung process is killed the
    pair breaks and leaves the transport's table."""
    import subprocess
    import sys

    from pdserve.kv_transfer.reservations import TransferError

    peer = subprocess.Popen([sys.executable, "-c", _HUNG_PEER], stdout=subprocess.PIPE, text=True)
    try:
        endpoint = f"127.0.0.1:{peer.stdout.readline().strip()}/hung/1/key?piece_tokens=8"
        side = TorchTransport("p", LAYOUT, "cpu", max_piece_tokens=8, timeout_s=600, num_staging_buffers=2,
                              send_deadline_s=1.0)
        sender = connect(side, endpoint)
        assert peer.stdout.readline().strip() == "formed"
        kv = torch.randn(8, 2, 8)
        with pytest.raises(TransferError, match="not reading") as stalled:
            for _ in range(10):  # 2 staging buffers and one piece on the wire: the 4th cannot be staged
                sender.send(1, 0, 0, kv, kv)
        with pytest.raises(TransferError, match="not reading"):
            sender.send(2, 0, 0, kv, kv)  # another request for the same peer: at once
        assert "kv_send_deadline_s" in str(stalled.value)
        assert side._senders.get(endpoint) is sender
    finally:
        peer.kill()
        peer.wait(30)
    sender._thread.join(60)  # the send on the wire fails with the peer's sockets closed
    assert not sender._thread.is_alive() and sender.broken
    assert endpoint not in side._senders, "a broken pair stays in the transport's table"


def test_an_idle_pair_outlives_the_groups_timeout():
    """The receiver waits for the next piece without the group's timeout (it bounds only the
    rendezvous): a pair idle for longer still carries the next transfer."""
    cache = torch.zeros(LAYOUT.num_layers, 2, 4, LAYOUT.block_size, 2, 8)
    table = ReservationTable(LAYOUT, cache)
    receiver = TorchTransport("d", LAYOUT, "cpu", max_piece_tokens=8, timeout_s=2)
    receiver.listen(table)
    sender = connect(TorchTransport("p", LAYOUT, "cpu", max_piece_tokens=8, timeout_s=2), receiver.accept("p"))
    time.sleep(3.5)  # idle past the 2 s timeout
    assert not receiver._receivers["p"].broken
    ship_six_tokens(table, sender, receiver)


def test_a_pair_superseded_by_a_new_endpoint_is_retired_on_the_prefill_side():
    """When the decode worker hands out a new endpoint for a prefill worker (its side of the
    old pair broke), joining the new pair retires the old sender: out of the table, its thread
    ended, nothing left per pair that is gone."""
    import gc

    cache = torch.zeros(LAYOUT.num_layers, 2, 4, LAYOUT.block_size, 2, 8)
    table = ReservationTable(LAYOUT, cache)
    receiver = TorchTransport("d", LAYOUT, "cpu", max_piece_tokens=8)
    receiver.listen(table)
    side = TorchTransport("p", LAYOUT, "cpu", max_piece_tokens=8)
    first = receiver.accept("p")
    old = connect(side, first)
    old_receiver = receiver._receivers["p"]
    old_receiver.broken = True  # as if its receive had failed: the next accept forms a new pair
    second = receiver.accept("p")
    assert second != first
    new = connect(side, second)
    old._thread.join(30)
    assert not old._thread.is_alive() and old.broken and "superseded" in old.broken
    assert list(side._senders) == [second]
    ship_six_tokens(table, new, receiver)
    del old
    gc.collect()  # the retired sender's group goes, closing its sockets: the old receiver's wait ends
    old_receiver.join(30)
    assert not old_receiver.is_alive()
