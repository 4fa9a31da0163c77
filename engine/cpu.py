"""What this machine's CPU can do, read from /proc/cpuinfo (Linux).

Used to key kernel builds by instruction set and to decide whether `dtype="auto"` runs
in bf16: only when the CPU has native bf16 arithmetic (AVX512-BF16 dot products or AMX
bf16 tiles). Without it torch emulates bf16 through fp32 conversions and bf16 is slower
than fp32, so the feature is detected, never guessed from the vendor or model name.
"""

from __future__ import annotations

import functools
from pathlib import Path

NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
_WANTED = ("vendor_id", "cpu family", "model", "model name", "flags", "features", "cpu part")


@functools.cache
def first_cpu_info() -> dict[str, str]:
    """The first CPU's identifying fields from /proc/cpuinfo; empty where it is missing."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return {}
    info: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in _WANTED and key not in info:
            info[key] = value.strip()
    return info


def cpu_flags() -> set[str]:
    """The CPU's feature flags (x86 `flags`, Arm `features`)."""
    info = first_cpu_info()
    return set((info.get("flags") or info.get("features") or "").split())


def native_bf16_flags(flags: set[str] | None = None) -> list[str]:
    """Which of the flags that mean native bf16 arithmetic this CPU has (sorted; empty if none)."""
    flags = cpu_flags() if flags is None else flags
    return sorted(f for f in NATIVE_BF16_FLAGS if f in flags)
