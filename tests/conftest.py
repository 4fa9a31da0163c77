import os
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

# CI runs the same examples every time (no random seed, no example database replaying
# earlier failures); local runs keep exploring with hypothesis' default profile.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI", "").lower() == "true":
    settings.load_profile("ci")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded default model, converted from its GGUF once per cache dir."""
    from engine.config import DEFAULT_MODEL
    from engine.model_source import resolve_model

    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_dir) -> Path:
    from testkit.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", smollm2_dir)


@pytest.fixture(scope="session")
def tiny_llama3_rope_dir(tmp_path_factory, smollm2_dir) -> Path:
    from testkit.models import build_tiny_model

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama3"), "llama", smollm2_dir,
                            seed=1, rope_parameters=rope, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, smollm2_dir) -> Path:
    from testkit.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", smollm2_dir, seed=2)


@pytest.fixture(scope="session")
def cpu_kernels():
    """The compiled CPU kernels module (skips the test where it cannot be built)."""
    from engine.model import kernels

    built = kernels.cpu_kernels()
    if built is None:
        pytest.skip("the C++ kernels cannot be built here")
    return built
