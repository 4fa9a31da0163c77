"""The scheduler as pure bookkeeping: no model, no tensors."""

import subprocess
import sys

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerConfig


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=16, max_model_len=128):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len), bm), bm


def req(rid, prompt_len, max_tokens=4, **params):
    return Request(rid, list(range(3, 3 + prompt_len)),
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params), seed=0,
                   eos_token_ids=frozenset({2}))


def run_step(sched, token=7):
    out = sched.schedule()
    finished = sched.update(out, {c.request_id: token for c in out.chunks if c.sample})
    return out, finished


def test_scheduler_imports_no_torch():
    code = "import sys, engine.scheduler; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_chunked_prefill_respects_the_token_budget():
    sched, _ = make(budget=16)
    sched.add_request(req("a", 40))
    sizes = []
    while True:
        out, _ = run_step(sched)
        chunk = out.chunks[0]
        sizes.append(len(chunk.token_ids))
        if chunk.sample:
            break
    assert sizes == [16, 16, 8]  # the last chunk reaches the end and samples


def test_running_requests_go_first_and_new_ones_fill_the_budget():
    sched, _ = make(budget=10)
    sched.add_request(req("a", 3, max_tokens=10))
    run_step(sched)  # a prefilled, now decoding
    sched.add_request(req("b", 30))
    out, _ = run_step(sched)
    assert [c.request_id for c in out.chunks] == ["a", "b"]
    assert [len(c.token_ids) for c in out.chunks] == [1, 9]


def test_max_num_seqs_caps_the_batch():
    sched, _ = make(max_num_seqs=2, budget=100)
    for rid in "abc":
        sched.add_request(req(rid, 3))
    out, _ = run_step(sched)
    assert [c.request_id for c in out.chunks] == ["a", "b"]


def test_preempts_the_latest_request_and_recomputes_it():
    sched, bm = make(num_blocks=6, block_size=4, budget=64, max_model_len=24)
    sched.add_request(req("a", 8, max_tokens=10))
    sched.add_request(req("b", 8, max_tokens=10))
    run_step(sched)  # both prefilled: 2 blocks each, 2 free
    while not sched.num_preemptions:
        out, _ = run_step(sched)
    assert out.preempted_ids == ["b"]
    b = sched.requests["b"]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert b.output_token_ids  # keeps what it generated; recomputes prompt + outputs
    while sched.has_unfinished():
        run_step(sched)
    assert bm.num_free_blocks == bm.num_blocks


def test_finish_on_length_frees_blocks():
    sched, bm = make()
    sched.add_request(req("a", 5, max_tokens=3))
    finished = []
    while not finished:
        _, finished = run_step(sched)
    assert finished[0].status is RequestStatus.FINISHED_LENGTH
    assert len(finished[0].output_token_ids) == 3
    assert bm.num_free_blocks == bm.num_blocks


def test_eos_and_stop_token_ids():
    sched, _ = make()
    r = Request("a", [5, 6], SamplingParams(max_tokens=9), seed=0, eos_token_ids=frozenset({2}))
    sched.add_request(r)
    _, finished = run_step(sched, token=2)
    assert finished and finished[0].status is RequestStatus.FINISHED_STOPPED
    sched.add_request(req("b", 2, max_tokens=9, stop_token_ids=(7,)))
    _, finished = run_step(sched, token=7)
    assert finished[0].request_id == "b" and finished[0].status is RequestStatus.FINISHED_STOPPED


def test_ignore_eos_keeps_going():
    sched, _ = make()
    sched.add_request(req("a", 2, max_tokens=3))
    _, finished = run_step(sched, token=2)
    assert not finished


def test_abort_while_waiting_and_running_frees_everything():
    sched, bm = make(max_num_seqs=1)
    sched.add_request(req("a", 5, max_tokens=50))
    sched.add_request(req("b", 5))
    run_step(sched)
    sched.finish("b", RequestStatus.FINISHED_ABORTED)  # waiting
    sched.finish("a", RequestStatus.FINISHED_ABORTED)  # running
    assert not sched.has_unfinished()
    assert bm.num_free_blocks == bm.num_blocks
    assert sched.finish("a", RequestStatus.FINISHED_ABORTED) is None  # idempotent


def test_stops_at_max_model_len():
    sched, _ = make(max_model_len=8)
    sched.add_request(req("a", 6, max_tokens=100))
    finished = []
    while not finished:
        _, finished = run_step(sched)
    assert finished[0].status is RequestStatus.FINISHED_LENGTH
    assert finished[0].num_tokens == 8


def test_a_prefill_worker_load_never_preempts_when_one_longest_prompt_fits():
    """What prefill workers run: prompts only (max_tokens=1). With the least cache an engine
    accepts (one max_model_len request), prompts of random lengths arriving at random steps
    all finish and none is ever preempted: a running prompt only ever competes with cache
    blocks that can be evicted. (A leg's KV pieces are shipped once each even if one were.)"""
    import random

    rng = random.Random(0)
    max_model_len, block_size = 128, 4
    sched, bm = make(num_blocks=max_model_len // block_size, block_size=block_size, budget=24,
                     max_model_len=max_model_len)
    added = finished = 0
    for _ in range(2000):
        if added < 300 and rng.random() < 0.5:
            sched.add_request(req(f"r{added}", rng.randint(1, max_model_len - 1), max_tokens=1))
            added += 1
        if sched.has_unfinished():
            finished += len(run_step(sched)[1])
    assert added == 300 and finished == added and not sched.has_unfinished(), (added, finished)
    assert sched.num_preemptions == 0
    assert bm.num_free_blocks == bm.num_blocks
