"""The suite refuses the silent paths: in CI a skipped test fails the run, and a C++ kernel
that does not build fails `make test` (and every test that needs the kernels) instead of
letting the rest pass on the torch fallback."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIPPING_TEST = """
import pytest

def test_runs():
    assert True

def test_skips():
    pytest.skip("no widget here")
"""


def run_pytest(test_file: Path, ci: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CI": ci}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           "--rootdir", str(test_file.parent), str(test_file)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_in_ci_a_skip_fails_the_run(tmp_path):
    test_file = tmp_path / "test_sample.py"
    test_file.write_text(SKIPPING_TEST)
    in_ci = run_pytest(test_file, "true")
    assert in_ci.returncode == 1, in_ci.stdout[-2000:]
    assert "test_sample.py::test_skips: no widget here" in in_ci.stdout
    assert "1 unexpected skip(s)" in in_ci.stdout
    outside = run_pytest(test_file, "")
    assert outside.returncode == 0, outside.stdout[-2000:]  # a developer's machine may lack a widget


def kernels_main(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k != "PDSERVE_DISABLE_CPU_KERNEL"}
    return subprocess.run([sys.executable, "-m", "pdserve.engine.model.kernels"], cwd=ROOT, capture_output=True,
                          text=True, env={**clean, "PDSERVE_CACHE": str(tmp_path), **env}, timeout=300)


def test_a_kernel_that_does_not_build_fails_the_build_step(tmp_path):
    broken = kernels_main(tmp_path, CXX="/bin/false")  # a compiler that fails
    assert broken.returncode == 1
    assert "CPU kernels failed to build" in broken.stderr and "/bin/false" in broken.stderr
    asked = kernels_main(tmp_path, CXX="/bin/false", PDSERVE_DISABLE_CPU_KERNEL="1")
    assert asked.returncode == 0 and "disabled by PDSERVE_DISABLE_CPU_KERNEL=1" in asked.stdout


def test_ci_script_refuses_the_fallback_and_sets_ci():
    script = (ROOT / ".ci" / "run").read_text()
    assert "export CI=true" in script
    assert "PDSERVE_DISABLE_CPU_KERNEL" in script and "RAY_AUTH_MODE=disabled" not in script
    refused = subprocess.run(["bash", str(ROOT / ".ci" / "run")], cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "PDSERVE_DISABLE_CPU_KERNEL": "1"}, timeout=60)
    assert refused.returncode != 0 and "PDSERVE_DISABLE_CPU_KERNEL" in refused.stderr
