"""A prefill leg ships every position of every layer exactly once, from where the decode
worker's cache ends, whatever order chunks are computed in: a prompt computed again after a
preemption, or resumed from this worker's prefix cache, sends nothing twice and leaves no gap."""

import random

from pdserve.prefill_worker.service import _Shipment


def shipped_positions(shipment: _Shipment, chunks: list[tuple[int, int]], layer: int = 0) -> list[int]:
    """Run `plan` over (token_start, num_tokens) chunks; every position it says to send."""
    sent = []
    for start, count in chunks:
        from_cache, cut = shipment.plan(layer, start, count)
        sent += range(from_cache, start)
        sent += range(start + cut, start + count)
    return sent


def test_a_prompt_in_chunks_ships_each_position_once():
    assert shipped_positions(_Shipment(1, None), [(0, 16), (16, 16), (32, 5)]) == list(range(37))


def test_positions_the_decode_worker_holds_are_not_shipped():
    assert shipped_positions(_Shipment(1, None, skip_below=32), [(0, 16), (16, 20)]) == list(range(32, 36))


def test_a_prefix_from_this_workers_cache_is_shipped_from_the_cache_first():
    shipment = _Shipment(1, None, skip_below=16)
    assert shipment.plan(0, 48, 10) == (16, 0)  # [16, 48) from the cache, then the chunk
    assert shipped_positions(_Shipment(1, None, skip_below=16), [(48, 10)]) == list(range(16, 58))


def test_recomputation_after_a_preemption_sends_nothing_twice():
    before = [(0, 16), (16, 16)]
    again = [(0, 16), (16, 16), (32, 16), (48, 3)]  # preempted, then recomputed from the start
    from_cached = [(16, 16), (32, 16), (48, 3)]  # preempted, then resumed from its cached blocks
    for after in (again, from_cached):
        assert shipped_positions(_Shipment(1, None), before + after) == list(range(51))


def test_any_restart_pattern_ships_a_contiguous_run_exactly_once():
    rng = random.Random(0)
    for _ in range(200):
        length, skip = rng.randint(1, 200), rng.randrange(0, 200, 16)
        chunks, done = [], 0
        while done < length:  # computed in chunks, sometimes restarting from an earlier block
            if done and rng.random() < 0.2:
                done = rng.randrange(0, done + 1, 16) if done >= 16 else 0
            count = min(rng.randint(1, 48), length - done)
            chunks.append((done, count))
            done += count
        sent = shipped_positions(_Shipment(1, None, skip_below=min(skip, length - 1)), chunks)
        assert sent == list(range(min(skip, length - 1), length)), chunks
