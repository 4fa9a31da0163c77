"""The decode side's KV validation: every malformed piece is rejected with a clear error
and changes no other state."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.reservations import ReservationTable, TransferError

LAYOUT = KVLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")


@pytest.fixture
def table():
    cache = torch.zeros(3, 2, 10, 4, 2, 8)
    return ReservationTable(LAYOUT, cache), cache


def piece(num_tokens: int, fill: float = 1.0):
    return torch.full((num_tokens * LAYOUT.token_elements,), fill)


def test_pieces_land_in_the_reserved_slots_and_complete(table):
    tbl, cache = table
    done = []
    res = tbl.register("r", [7, 2], num_tokens=6, on_done=lambda: done.append(1))
    for layer in range(3):
        tbl.write(res.transfer_id, layer, 0, 4, piece(4, layer + 1.0))
        tbl.write(res.transfer_id, layer, 4, 2, piece(2, layer + 1.0))
    assert done == [1] and res.complete
    assert (cache[1, :, 7] == 2.0).all()  # block 7 holds tokens 0..3
    assert (cache[2, :, 2, :2] == 3.0).all() and (cache[2, :, 2, 2:] == 0).all()  # tokens 4, 5 only
    assert cache[:, :, [0, 1, 3, 4, 5, 6, 8, 9]].abs().sum() == 0  # nothing else touched


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((999, 0, 0, 2), r"unknown transfer id 999"),
        ((None, 3, 0, 2), r"layer 3 outside \[0, 3\)"),
        ((None, 0, 5, 2), r"tokens \[5, 7\) outside the reservation of 6"),
        ((None, 0, 0, 0), r"outside the reservation"),
    ],
)
def test_bad_pieces_are_rejected_without_writing(table, args, message):
    tbl, cache = table
    res = tbl.register("r", [1, 2], num_tokens=6)
    transfer_id, layer, start, count = args
    with pytest.raises(TransferError, match=message):
        tbl.write(transfer_id or res.transfer_id, layer, start, count, piece(max(count, 1)))
    assert cache.abs().sum() == 0


def test_wrong_size_and_dtype(table):
    tbl, cache = table
    res = tbl.register("r", [1, 2], num_tokens=6)
    with pytest.raises(TransferError, match=r"payload of 63 torch.float32 elements; expected 64"):
        tbl.write(res.transfer_id, 0, 0, 2, piece(2)[:-1])
    with pytest.raises(TransferError, match=r"expected 64 torch.float32"):
        tbl.write(res.transfer_id, 0, 0, 2, piece(2).double())
    with pytest.raises(TransferError, match=r"payload of 10 bytes; expected 256"):
        tbl.write_bytes(res.transfer_id, 0, 0, 2, b"0" * 10)  # truncated
    assert cache.abs().sum() == 0


def test_duplicate_piece_and_foreign_peer(table):
    tbl, _ = table
    res = tbl.register("r", [1, 2], num_tokens=6, peer="P1")
    tbl.write(res.transfer_id, 0, 0, 2, piece(2), peer="P1")
    with pytest.raises(TransferError, match=r"sent twice"):
        tbl.write(res.transfer_id, 0, 1, 2, piece(2), peer="P1")
    with pytest.raises(TransferError, match=r"belongs to P1, not P2"):
        tbl.write(res.transfer_id, 1, 0, 2, piece(2), peer="P2")


def test_one_bad_transfer_leaves_others_alone(table):
    tbl, cache = table
    good = tbl.register("good", [3], num_tokens=4)
    bad = tbl.register("bad", [4], num_tokens=4)
    tbl.fail(bad.transfer_id, "peer sent garbage")
    with pytest.raises(TransferError, match="already peer sent garbage"):
        tbl.write(bad.transfer_id, 0, 0, 4, piece(4))
    for layer in range(3):
        tbl.write(good.transfer_id, layer, 0, 4, piece(4))
    assert good.complete and bad.error == "peer sent garbage"
    assert cache[:, :, 4].abs().sum() == 0


def test_after_release_nothing_can_write(table):
    tbl, cache = table
    res = tbl.register("r", [5], num_tokens=4)
    tbl.release(res.transfer_id)
    with pytest.raises(TransferError, match="unknown transfer id"):
        tbl.write(res.transfer_id, 0, 0, 4, piece(4))
    assert cache.abs().sum() == 0 and len(tbl) == 0


def test_layout_mismatch_names_fields():
    other = KVLayout(num_layers=3, block_size=16, num_kv_heads=2, head_dim=8, dtype="bfloat16")
    message = LAYOUT.mismatch(other)
    assert "block_size: 4 vs 16" in message and "dtype: float32 vs bfloat16" in message
    assert LAYOUT.mismatch(LAYOUT) is None
    with pytest.raises(ValueError, match="dtype must be one of"):
        KVLayout(1, 1, 1, 1, "int8")


@settings(max_examples=60, deadline=None)
@given(blocks=st.permutations(list(range(12))), num_blocks=st.integers(1, 12), trim=st.integers(0, 15),
       bounds=st.lists(st.integers(1, 191), max_size=4), dtype=st.sampled_from(["float32", "bfloat16"]))
def test_pieces_land_where_index_copy_would_put_them(blocks, num_blocks, trim, bounds, dtype):
    """Pieces are copied through numpy as whole blocks, runs of slots and single tokens: the
    cache must end up exactly as a plain index_copy_ of each piece leaves it, for any block
    table, piece boundaries and dtype (bf16 has no numpy dtype: it moves as int16)."""
    bs = 16
    layout = KVLayout(num_layers=1, block_size=bs, num_kv_heads=2, head_dim=4, dtype=dtype)
    # one run, sorted (some runs), and shuffled tables
    table = [list(range(12 - num_blocks, 12)), sorted(blocks[:num_blocks]), blocks[:num_blocks]][trim % 3]
    num_tokens = max(1, num_blocks * bs - trim)
    cache = torch.zeros(1, 2, 12, bs, 2, 4, dtype=layout.torch_dtype)
    tbl = ReservationTable(layout, cache)
    res = tbl.register("r", table, num_tokens)
    payload = torch.randn(2, num_tokens, 2, 4).to(layout.torch_dtype)
    cuts = sorted({0, num_tokens, *(b for b in bounds if b < num_tokens)})
    for begin, end in zip(cuts[:-1], cuts[1:], strict=True):
        piece = payload[:, begin:end].reshape(-1)
        tbl.write(res.transfer_id, 0, begin, end - begin, piece)
    expected = torch.zeros_like(cache)
    for half in range(2):
        expected[0, half].view(-1, 2, 4).index_copy_(0, res.slots, payload[half])
    assert res.complete and torch.equal(cache, expected)


def test_host_copy_gathers_strided_views_and_refuses_a_dtype_change():
    """The sender packs K/V views of a fused projection (strided rows) into its staging."""
    from pdserve.kv_transfer.layout import host_copy

    fused = torch.randn(5, 3, 8).to(torch.bfloat16)
    dst = torch.empty(5, 1, 8, dtype=torch.bfloat16)
    host_copy(dst, fused[:, 1:2])
    assert torch.equal(dst, fused[:, 1:2])
    with pytest.raises(TypeError, match="bfloat16 into torch.float32"):
        host_copy(torch.empty(5, 1, 8), fused[:, 1:2])


def test_a_delta_reservation_refuses_the_positions_it_holds_already():
    cache = torch.zeros(LAYOUT.num_layers, 2, 8, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    table = ReservationTable(LAYOUT, cache)
    res = table.register("r", [0, 1, 2, 3], 14, num_cached_tokens=8)
    piece = torch.ones(2 * 3 * LAYOUT.num_kv_heads * LAYOUT.head_dim)
    with pytest.raises(TransferError, match="held already"):
        table.write(res.transfer_id, 0, 6, 3, piece)  # overlaps the cached positions 6, 7
    assert not cache[:, :, :2].any(), "the shared cached blocks must stay untouched"
    with pytest.raises(TransferError, match="outside the reservation"):
        table.write(res.transfer_id, 0, 12, 3, piece)
    for layer in range(LAYOUT.num_layers):
        table.write(res.transfer_id, layer, 8, 3, piece)
        table.write(res.transfer_id, layer, 11, 3, piece)
    assert res.complete and not cache[:, :, :2].any()
    with pytest.raises(ValueError, match="cached tokens"):
        table.register("s", [4, 5], 8, num_cached_tokens=8)
