"""`dtype="auto"` follows the CPU's native bf16 support, read from its feature flags."""

import torch

from pdserve.engine import loader
from pdserve.engine.cpu import native_bf16_flags


def test_native_bf16_is_read_from_the_flags():
    assert native_bf16_flags({"avx2", "avx512f", "avx512_bf16"}) == ["avx512_bf16"]
    assert native_bf16_flags({"amx_tile", "amx_bf16", "avx512_bf16"}) == ["amx_bf16", "avx512_bf16"]
    # AVX-512 alone (or a vendor) is not native bf16 arithmetic
    assert native_bf16_flags({"avx2", "avx512f", "avx512bw"}) == []
    assert native_bf16_flags(set()) == []


def test_auto_picks_bf16_only_where_the_cpu_has_it(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(loader, "native_bf16_flags", lambda: ["amx_bf16"])
    dtype, why = loader.auto_dtype(cpu)
    assert dtype == torch.bfloat16 and "amx_bf16" in why
    monkeypatch.setattr(loader, "native_bf16_flags", lambda: [])
    dtype, why = loader.auto_dtype(cpu)
    assert dtype == torch.float32 and "no native bf16" in why
    assert loader.auto_dtype(torch.device("cuda"))[0] == torch.bfloat16


def test_an_explicit_dtype_is_kept_whatever_the_cpu(monkeypatch):
    from pdserve.engine.config import EngineConfig

    monkeypatch.setattr(loader, "native_bf16_flags", lambda: ["avx512_bf16"])
    assert loader.resolve_device_dtype(EngineConfig(device="cpu", dtype="float32"))[1] == torch.float32
    assert loader.resolve_device_dtype(EngineConfig(device="cpu"))[1] == torch.bfloat16
