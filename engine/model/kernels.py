"""The CPU kernels (csrc/): paged decode and prefill attention (vectorised for AVX-512 or AVX2,
portable otherwise), the fused token-wise ops of a layer (RMSNorm with the residual add,
SwiGLU's silu-times-up, RoPE) and, with AVX-512, the linear layers on panel-packed weights
(engine.model.linear; bf16 on AMX tiles where the CPU has amx_bf16), compiled on first use.

Compiled on the machine that runs it (so `-march=native` is safe) into the pdserve cache and
reused afterwards. The build directory is keyed by everything the binary depends on: the
source, torch's version, the compiler flags and the CPU's instruction set, so a cache shared
between machines (an NFS home, a copied image) never hands one CPU another's binary.
If no C++ compiler is available the engine falls back to a gather-based torch path, which
is correct but slower; `cpu_kernels()` returns None in that case.
Set `PDSERVE_DISABLE_CPU_KERNEL=1` to force the fallback, or `PDSERVE_CPU_KERNEL_MARCH` (e.g.
`haswell`: AVX2 without AVX-512) to build for an older instruction set than this CPU's (the
tests run the kernels' checks on such a build: tests/integration/test_kernels_avx2.py).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
from pathlib import Path

import torch

from pdserve.engine.cpu import first_cpu_info

logger = logging.getLogger(__name__)
_SOURCES = tuple(Path(__file__).parent / "csrc" / name
                 for name in ("paged_attention.cpp", "paged_prefill.cpp", "fused_ops.cpp", "panel_linear.cpp",
                              "bindings.cpp"))
_HEADERS = tuple(Path(__file__).parent / "csrc" / name  # copied, not compiled
                 for name in ("attention_common.h", "elementwise.h", "vector_bf16.h", "amx.h", "panel_amx.h"))
_CFLAGS = ("-O3", "-ffast-math", f"-march={os.environ.get('PDSERVE_CPU_KERNEL_MARCH') or 'native'}", "-fopenmp")
_LDFLAGS = ("-fopenmp", "-lmvec")


def cpu_instruction_set() -> str:
    """What `-march=native` compiles for: the CPU model and its feature flags (Linux
    /proc/cpuinfo), or the platform's description where that file is missing."""
    import platform

    info = first_cpu_info()
    return repr(sorted(info.items())) if info else platform.platform()


def build_tag(source: bytes) -> str:
    """Key of a kernel build: sources, torch version and install, flags and this CPU's
    instruction set. The install is part of it because torch writes the build's include
    paths into its ninja file: two environments sharing one build dir (a venv and the one
    `ray up` makes on the same host, with one cache) rebuilt it for each other in turn."""
    parts = [source, torch.__version__.encode(), str(Path(torch.__file__).parent).encode(),
             " ".join(_CFLAGS + _LDFLAGS).encode(), cpu_instruction_set().encode()]
    return hashlib.sha1(b"\0".join(parts)).hexdigest()[:12]


@functools.cache
def cpu_kernels():
    """Return the compiled extension module, or None when it cannot be built here."""
    if disabled():
        return None
    from pdserve.engine.model_source import cache_dir, file_lock

    files = {path.name: path.read_bytes() for path in _SOURCES + _HEADERS}
    tag = build_tag(b"\0".join(files.values()))
    build_dir = cache_dir() / "torch_extensions" / f"cpu_kernels-{tag}"
    build_dir.mkdir(parents=True, exist_ok=True)
    # Compile copies inside the content-addressed build dir: every checkout then names the
    # same source paths, so torch does not rebuild for each one.
    for name, source in files.items():
        local = build_dir / name
        if not local.exists() or local.read_bytes() != source:
            local.write_bytes(source)
    try:
        from torch.utils.cpp_extension import load

        # torch's own lock file survives a process killed mid-build and then blocks every
        # later load forever; an fcntl lock dies with its holder, so under it any leftover
        # torch lock is stale and safe to remove.
        with file_lock(build_dir.parent / f".{build_dir.name}.lock"):
            (build_dir / "lock").unlink(missing_ok=True)
            if not (build_dir / "pdserve_cpu_kernels.so").exists():
                logger.warning("compiling the CPU kernels into %s (once per source, torch and CPU; ~40 s)",
                               build_dir)
            return load(
                name="pdserve_cpu_kernels",
                sources=[str(build_dir / path.name) for path in _SOURCES],
                build_directory=str(build_dir),
                extra_cflags=list(_CFLAGS),
                extra_ldflags=list(_LDFLAGS),
                verbose=False,
            )
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the fallback
        global build_error
        build_error = f"{type(exc).__name__}: {exc}".strip()
        logger.warning("CPU kernels unavailable (%s); using the torch path", exc)
        return None


build_error = ""  # why the last build failed ("" if it did not), for reports and tests


def disabled() -> bool:
    return os.environ.get("PDSERVE_DISABLE_CPU_KERNEL") == "1"


def main() -> int:
    """`python -m pdserve.engine.model.kernels` (make test runs it before the suite): build now. Exits 1
    when the build fails, so a machine with a C++ compiler never runs on the fallback unawares;
    0 when `PDSERVE_DISABLE_CPU_KERNEL=1` asks for the fallback."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if disabled():
        print("CPU kernels: disabled by PDSERVE_DISABLE_CPU_KERNEL=1 (the torch fallback will run)")
        return 0
    built = cpu_kernels()
    if built is None:
        print(f"CPU kernels failed to build: {build_error[-2000:]}\nInstall a C++ compiler with OpenMP "
              "(g++), or set PDSERVE_DISABLE_CPU_KERNEL=1 to run on the slower torch fallback.", file=sys.stderr)
        return 1
    print(f"CPU kernels: {built.__file__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
