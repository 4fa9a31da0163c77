"""The worker services use the engine through its public API only: requests, `load()`, and
the KV connector (`LLMEngine.kv_connector`), never the scheduler, block manager or model
runner behind it. A static check (ast) over every module of the worker packages, the
checker's own test, and the connector's contracts on a scheduler without a model."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import pdserve.engine
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.kv_connector import KVSchedulerSide, KVWorkerSide, slot_mapping
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerConfig

ROOT = Path(__file__).resolve().parents[2]
WORKER_PACKAGES = ("worker_base", "prefill_worker", "decode_worker")
# what sits behind LLMEngine's public API; no worker module may name these attributes
ENGINE_INTERNALS = {"scheduler", "block_manager", "runner", "kv_cache", "model_runner"}
# engine modules a worker may import; every other pdserve.engine.* module is internal
PUBLIC_ENGINE_MODULES = {"pdserve.engine"} | {f"pdserve.engine.{name}" for name in (
    "config", "arg_utils", "sampling_params", "outputs", "async_engine", "llm_engine", "kv_connector",
    "logs", "stats", "profile")}


def _internal_module(module: str) -> bool:
    return (module == "pdserve.engine" or module.startswith("pdserve.engine.")) and module not in PUBLIC_ENGINE_MODULES


def _imported_internals(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if _internal_module(alias.name)]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        if node.module == "pdserve.engine":  # the package's exports, or a module (`import scheduler`)
            return [f"pdserve.engine.{a.name}" for a in node.names
                    if a.name not in pdserve.engine.__all__ and _internal_module(f"pdserve.engine.{a.name}")]
        return [node.module] if _internal_module(node.module) else []
    return []


def engine_reaches(path: Path) -> list[str]:
    """Every place in the module at `path` that reaches past the engine's public API: an
    attribute named as an engine internal (also through getattr), a private attribute of
    something called `engine`, an import of an internal engine module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        where = f"{path.name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Attribute) and node.attr in ENGINE_INTERNALS:
            found.append(f"{where} .{node.attr}")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and (
                getattr(node.value, "id", None) == "engine" or getattr(node.value, "attr", None) == "engine"):
            found.append(f"{where} engine.{node.attr}")
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) > 1 \
                and isinstance(node.args[1], ast.Constant) and node.args[1].value in ENGINE_INTERNALS:
            found.append(f"{where} getattr {node.args[1].value!r}")
        found += [f"{where} imports {module}" for module in _imported_internals(node)]
    return found


@pytest.mark.parametrize("package", WORKER_PACKAGES)
def test_worker_packages_use_only_the_public_engine_api(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no modules found in {package}/"
    reaches = [f"{package}/{reach}" for path in files for reach in engine_reaches(path)]
    assert not reaches, reaches


def test_the_checker_sees_every_kind_of_reach(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "import pdserve.engine.block_manager\n"
        "from pdserve.engine.scheduler import Scheduler\n"
        "from pdserve.engine import LLMEngine, model_runner\n"
        "def f(self):\n"
        "    from pdserve.engine.request import Request\n"
        "    running = self.engine.scheduler.running\n"
        "    cache = self.engine.runner.kv_cache\n"
        "    tracked = self.engine._tracked\n"
        "    return getattr(self.engine, 'block_manager')\n")
    assert {reach.split(" ", 1)[1] for reach in engine_reaches(module)} == {
        "imports pdserve.engine.block_manager", "imports pdserve.engine.scheduler",
        "imports pdserve.engine.model_runner", "imports pdserve.engine.request", ".scheduler", ".runner",
        ".kv_cache", "engine._tracked", "getattr 'block_manager'"}


def test_a_reach_put_back_into_a_service_fails_the_check(tmp_path):
    source = (ROOT / "decode_worker" / "service.py").read_text()
    clean = tmp_path / "clean.py"
    clean.write_text(source)
    assert engine_reaches(clean) == []
    broken = tmp_path / "broken.py"
    broken.write_text(source + "\n\ndef _busy(service):\n    return len(service.engine.scheduler.requests)\n")
    assert [reach.split(" ", 1)[1] for reach in engine_reaches(broken)] == [".scheduler"]


def test_public_api_imports_pass_the_checker(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from pdserve.engine import LLMEngine, SamplingParams\n"
                      "from pdserve.engine.kv_connector import KVConnector\n"
                      "from pdserve.engine.stats import EngineLoad\n"
                      "def f(engine):\n    return engine.kv_connector.scheduler_side.num_reserved, engine.load()\n")
    assert engine_reaches(module) == []


# ------------------------------------------------------------ the connector's scheduler side
BS = 4


def scheduler_side(num_blocks=16, max_num_seqs=4):
    """A scheduler side over a real scheduler; admitting moves the request into the batch."""
    sched = Scheduler(SchedulerConfig(max_num_seqs, 64, 256), BlockManager(num_blocks, BS))

    def admit_running(request_id, ids, params, first_token, *_):
        request = Request(request_id, list(ids), params, seed=0, eos_token_ids=frozenset({2}))
        request.output_token_ids.append(first_token)
        sched.add_running(request)
        return request_id

    side = KVSchedulerSide(sched, admit_running, lambda rid: rid in sched.requests, set())
    return side, sched


def params():
    return SamplingParams(max_tokens=8, ignore_eos=True)


def test_a_reservation_is_open_from_reserve_to_admit():
    side, sched = scheduler_side()
    assert side.reserve("a", list(range(3, 13))) == 0  # nothing cached
    assert side.num_reserved == 1 and len(side.block_table("a")) == 3
    side.admit("a", list(range(3, 13)), params(), 7)
    assert side.num_reserved == 0 and [r.request_id for r in sched.running] == ["a"]
    with pytest.raises(ValueError, match="in use"):
        side.reserve("a", list(range(3, 13)))
    side.release("a")  # a running request's blocks are its own
    assert len(side.block_table("a")) == 3


def test_release_frees_the_blocks_and_is_idempotent():
    side, sched = scheduler_side()
    side.reserve("a", list(range(3, 13)))
    side.release("a")
    side.release("a")
    assert side.num_reserved == 0 and sched.block_manager.num_free_blocks == 16
    sched.block_manager.check_integrity()


def test_reserve_starts_with_the_cached_prefix_and_counts_the_lookup():
    side, sched = scheduler_side()
    prompt = list(range(3, 15))
    side.reserve("a", prompt)
    sched.block_manager.commit("a", len(prompt), lambda s, e: prompt[s:e])
    assert side.cached_tokens(prompt) == 8  # whole blocks, short of the last token
    assert side.reserve("b", prompt) == 8
    assert side.block_table("b")[:2] == side.block_table("a")[:2]
    assert sched.num_cache_queries == 2 and sched.num_cache_hit_tokens == 8


def test_the_headroom_counts_open_reservations_and_running_requests():
    side, _ = scheduler_side(num_blocks=8, max_num_seqs=2)
    assert side.reserve("a", list(range(3, 19))) == 0  # 4 blocks
    assert side.reserve("b", list(range(3, 7))) is not None  # 1 block: 3 left
    assert side.reserve("c", list(range(3, 7))) is None  # max_num_seqs counts the two reservations
    side.release("b")
    side.admit("a", list(range(3, 19)), params(), 7)  # running now: needs a block kept free
    assert side.reserve("d", list(range(3, 19))) is None  # 4 free, 4 needed + 1 for `a`'s next token
    assert side.reserve("d", list(range(3, 15))) is not None  # 3 needed + 1


def test_a_prompt_as_large_as_the_cache_is_taken_when_nothing_else_is_in_flight():
    side, _ = scheduler_side(num_blocks=4)
    assert side.reserve("a", list(range(3, 19))) == 0


# ------------------------------------------------------------ the worker side
def test_slot_mapping_follows_the_block_table():
    assert slot_mapping([5, 2, 9], 2, 7, BS).tolist() == [22, 23, 8, 9, 10]
    assert slot_mapping(np.asarray([1]), 0, 0, BS).tolist() == []


def test_read_returns_the_kv_of_the_given_blocks_and_positions():
    cache = torch.arange(2 * 2 * 4 * BS * 2 * 3, dtype=torch.float32).view(2, 2, 4, BS, 2, 3)
    side = KVWorkerSide(SimpleNamespace(kv_cache=cache, kv_hook=None))
    k, v = side.read([3, 1], 1, 2, 6)
    assert torch.equal(k, torch.stack([cache[1, 0, 3, 2], cache[1, 0, 3, 3], cache[1, 0, 1, 0], cache[1, 0, 1, 1]]))
    assert torch.equal(v, torch.stack([cache[1, 1, 3, 2], cache[1, 1, 3, 3], cache[1, 1, 1, 0], cache[1, 1, 1, 1]]))
    assert side.cache_tensor is cache


def test_a_dropped_engine_is_freed_at_once_with_its_connector_in_use(tiny_llama_dir):
    """No reference cycle through the connector: the engine goes when its last reference
    does, not at interpreter shutdown (where destroying one aborted `pdserve profile`)."""
    import gc
    import weakref

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32"))
    side = engine.kv_connector.scheduler_side
    assert side.reserve("r", [1, 2, 3, 4, 5]) == 0 and engine.kv_connector.scheduler_side.num_reserved == 1
    side.release("r")
    gone = weakref.ref(engine)
    gc.disable()
    try:
        del engine, side
        assert gone() is None, "the engine outlived its last reference (a reference cycle)"
    finally:
        gc.enable()
