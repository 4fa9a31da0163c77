"""The step log: each engine step's work in the latency model's terms (T prompt tokens,
their attention Q, B decode rows, their context C) and its time, written as JSONL when
PDSERVE_STEP_LOG asks for it, by the real engine driven through the real AsyncEngine."""

import asyncio

import pytest

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.step_log import ENV, StepLog, StepShape, read_step_logs


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_num_batched_tokens=64))


def _drain(engine):
    while engine.has_unfinished_requests():
        engine.step()


def test_shapes_of_prefill_chunks_decodes_and_mixed_steps(engine):
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    engine.add_request("a", list(range(10, 110)), params)  # 100 tokens: chunks of 64 and 36
    engine.step()
    assert engine.last_step_shape == StepShape(64, 64 * 64, 0, 0)
    engine.add_request("b", list(range(200, 220)), params)  # joins behind a's last chunk
    engine.step()
    assert engine.last_step_shape == StepShape(36 + 20, 36 * 100 + 20 * 20, 0, 0, 36 * 64)  # a's over its first 64
    engine.add_request("c", list(range(300, 340)), params)
    engine.step()  # a and b decode (contexts 101 and 21), c's 40-token prompt rides along
    assert engine.last_step_shape == StepShape(40, 40 * 40, 2, 101 + 21)
    engine.step()
    assert engine.last_step_shape == StepShape(0, 0, 3, 102 + 22 + 41)
    _drain(engine)


def _serve_one(engine, request_id: str, prompt: list[int], max_tokens: int) -> None:
    """Run one request to its end through a real AsyncEngine named "decode" (its steps logged
    when PDSERVE_STEP_LOG is set)."""

    async def run():
        aengine = AsyncEngine(engine, name="decode")
        aengine.start()
        done = asyncio.Event()
        aengine.listeners[request_id] = lambda out: out.finished and done.set()
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        aengine.wake()
        await asyncio.wait_for(done.wait(), 60)
        await aengine.stop()

    asyncio.run(run())


def test_the_async_engine_logs_every_step_when_asked(engine, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path / "steps"))

    _serve_one(engine, "x", list(range(500, 530)), 4)
    rows = read_step_logs(tmp_path / "steps", "decode")
    assert [(r["T"], r["Q"], r["K"], r["B"], r["C"]) for r in rows] == [(30, 900, 0, 0, 0), (0, 0, 0, 1, 31),
                                                                         (0, 0, 0, 1, 32), (0, 0, 0, 1, 33)]
    assert all(r["s"] > 0 and r["name"] == "decode" for r in rows)
    assert [r["t"] for r in rows] == sorted(r["t"] for r in rows)
    # the CPU the stepping thread spent ("u") is part of what the process spent ("p") then
    assert all(0 <= r["u"] <= r["p"] + 1e-3 for r in rows)
    assert rows[0]["u"] > 0  # the 30-token prompt's step computed on the stepping thread


# How far a step's "p" - "u" may fall short of a neighbour's CPU inside it: "u" and "p" are
# rounded to 0.01 ms
ROUNDING_S = 2e-5
NEIGHBOUR_CPU_S = 0.005  # what the neighbour thread burns inside each step


def test_the_cpu_split_of_a_step_shows_a_busy_neighbour_thread(engine, tmp_path, monkeypatch):
    """A thread of the same process working inside the steps shows in "p" and not in "u":
    the record that tells a step's own compute from its process's other threads. Each step
    hands the neighbour a fixed amount of CPU work and waits (idle) until it is done, and the
    neighbour measures its own CPU time, so each step's share of it is known, however the
    machine schedules the threads."""
    import hashlib
    import threading
    import time

    monkeypatch.setenv(ENV, str(tmp_path / "steps"))
    go, done, stop = threading.Event(), threading.Event(), threading.Event()
    burnt: list[float] = []  # the neighbour's own CPU seconds inside each step

    def neighbour():
        block = bytes(1 << 16)
        while go.wait() and not stop.is_set():
            go.clear()
            start = time.thread_time()
            while time.thread_time() - start < NEIGHBOUR_CPU_S:
                hashlib.sha256(block).digest()
            burnt.append(time.thread_time() - start)
            done.set()

    real_step = engine.step

    def step_beside_a_busy_neighbour():
        outputs = real_step()
        go.set()
        assert done.wait(60), "the neighbour thread did not finish its work"
        done.clear()
        return outputs

    monkeypatch.setattr(engine, "step", step_beside_a_busy_neighbour)
    thread = threading.Thread(target=neighbour)
    thread.start()
    try:
        _serve_one(engine, "y", list(range(600, 630)), 6)
    finally:
        stop.set()
        go.set()
        thread.join()
    rows = read_step_logs(tmp_path / "steps", "decode")
    assert len(rows) == len(burnt) == 6  # the prompt's step and five decodes, each with its neighbour's work
    for row, neighbour_cpu in zip(rows, burnt, strict=True):
        assert row["p"] - row["u"] >= neighbour_cpu - ROUNDING_S, (row, neighbour_cpu)  # in "p", not in "u"


def test_no_log_unless_asked(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path))
    asked = StepLog("prefill")
    monkeypatch.delenv(ENV)
    unasked = StepLog("decode")
    for log in (asked, unasked):
        log.record(0.0, 0.1, StepShape(1, 1, 0, 0))
        log.close()
    assert [r["name"] for r in read_step_logs(tmp_path)] == ["prefill"]
