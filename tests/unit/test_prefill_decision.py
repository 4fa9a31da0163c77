"""The decode worker's per-request choice of where to prefill (the method alone, on a
stand-in for the worker's state)."""

from types import SimpleNamespace

from pdserve.decode_worker.service import DecodeService
from pdserve.engine.profile import Profile

# prefill: 5 ms + 0.1 ms/token per step; a running decode adds 1 ms per request per step
PROFILE = Profile("m", (0.005, 0.0001, 0.0), (0.002, 0.001, 0.0), kv_bytes_per_token=100_000,
                  kv_bandwidth_bytes_per_s=1e9, max_num_batched_tokens=512)


def worker(profile=None, running=0, queued_here=0, threshold=64):
    load = SimpleNamespace(num_running=running, running_tokens=100 * running, queued_prompt_tokens=queued_here)
    return SimpleNamespace(config=SimpleNamespace(local_prefill_max_tokens=threshold), profile=profile,
                           engine=SimpleNamespace(load=lambda: load, queued_prompt_tokens=lambda: queued_here))


def decide(w, num_tokens, cached, have_prefill=True, prefill_queue=0):
    return DecodeService._where_to_prefill(w, num_tokens, cached, have_prefill, prefill_queue)


def test_threshold_on_what_the_cache_lacks():
    w = worker()
    assert decide(w, 1000, 960) == ("local", "few_uncached_tokens")  # a chat's next turn
    assert decide(w, 1000, 0) == ("remote", "many_uncached_tokens")
    assert decide(w, 1000, 0, have_prefill=False) == ("local", "no_prefill_worker")


def test_short_tails_go_to_the_prefill_pool_once_they_pile_up_here():
    assert decide(worker(queued_here=24), 1000, 960) == ("local", "few_uncached_tokens")  # 40 + 24 <= 64
    assert decide(worker(queued_here=25), 1000, 960) == ("remote", "many_uncached_tokens")
    assert decide(worker(queued_here=500), 1000, 960, have_prefill=False) == ("local", "no_prefill_worker")


def test_latency_model_weighs_the_prefill_queue_and_transfer_against_local_interference():
    idle_here = worker(PROFILE)
    # a long prefill queue over there: prefilling 300 tokens here is faster
    assert decide(idle_here, 300, 0, prefill_queue=4000) == ("local", "latency_model")
    # nothing queued there (0.03 s prefill + 0.03 s transfer) vs a busy batch and queue here
    busy_here = worker(PROFILE, running=200, queued_here=2000)
    assert decide(busy_here, 300, 0, prefill_queue=0) == ("remote", "latency_model")
