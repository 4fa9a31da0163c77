"""The CPU kernel's build cache is keyed by everything the binary depends on."""

from pdserve.engine.model import kernels


def test_build_tag_changes_with_source_torch_and_cpu(monkeypatch):
    base = kernels.build_tag(b"source")
    assert kernels.build_tag(b"source") == base  # stable on one machine
    assert kernels.build_tag(b"source 2") != base
    monkeypatch.setattr(kernels.torch, "__version__", "0.0.0-other")
    assert kernels.build_tag(b"source") != base
    monkeypatch.undo()
    monkeypatch.setattr(kernels.torch, "__file__", "/another/venv/site-packages/torch/__init__.py")
    assert kernels.build_tag(b"source") != base  # another environment's torch, same version
    monkeypatch.undo()
    monkeypatch.setattr(kernels, "cpu_instruction_set", lambda: "a CPU without avx512")
    assert kernels.build_tag(b"source") != base


def test_instruction_set_names_this_cpu():
    described = kernels.cpu_instruction_set()
    assert described and described != "[]"
    assert "-march=native" in kernels._CFLAGS  # why the CPU must be part of the key
