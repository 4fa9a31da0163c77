"""The CPU attention kernels as a CPU without AVX-512 runs them: the kernel checks of
tests/unit/test_paged_attention_kernel.py (each token's prefill bits equal to its decode's,
batch invariance, the fp64 reference, slots past the context never read) and of
tests/unit/test_fused_ops.py (the token-wise ops and the greedy pick's row_argmax, whose
AVX-512 loops an AVX2 build replaces with portable ones) run again in a
fresh process whose kernels are compiled for AVX2 (`PDSERVE_CPU_KERNEL_MARCH=haswell`), as a
CPU without AVX-512 builds them: the vector kernels with 8 lanes (the tiled prefill and the
decode kernel it must agree with, bit for bit), and the portable decode kernel for other head
sizes. The build is checked to hold no AVX-512 instruction and to tile its prefill."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNIT_TESTS = [str(ROOT / "tests" / "unit" / name) for name in ("test_paged_attention_kernel.py", "test_fused_ops.py")]

pytestmark = pytest.mark.timeout(600)


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as cpuinfo:
        return next((set(line.split(":", 1)[1].split()) for line in cpuinfo if line.startswith("flags")), set())


def test_the_kernel_checks_pass_on_an_avx2_build(cpu_kernels):
    assert {"avx2", "fma"} <= _cpu_flags(), "this CPU cannot run an AVX2 build"
    env = {**os.environ, "PDSERVE_CPU_KERNEL_MARCH": "haswell"}
    probe = subprocess.run(
        [sys.executable, "-c", "from pdserve.engine.model.kernels import cpu_kernels; k = cpu_kernels(); "
         "print(k.__file__); print(k.tiled_prefill, k.panel_linear_dtypes)"],
        env=env, capture_output=True, text=True, timeout=600, check=True)
    library, features = probe.stdout.strip().splitlines()[-2:]
    assert features == "True []", "the AVX2 build does not tile its prefill, or reports AVX-512 linear layers"
    disassembly = subprocess.run(["objdump", "-d", library], capture_output=True, text=True, check=True).stdout
    assert "ymm" in disassembly and "zmm" not in disassembly, "the AVX2 build holds AVX-512 instructions"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *UNIT_TESTS],
                         env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]
