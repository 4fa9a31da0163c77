"""What a worker reports about its precision and threads: the thread count it gives torch,
and how `pdserve up` summarises the pools' dtypes."""

import os
import types

import pytest
import torch

from pdserve.cluster import actors
from pdserve.cluster.cli_service import _dtypes


def _status(prefill: list[str], decode: list[str]) -> dict:
    return {"pools": {"prefill": {"workers": [{"dtype": d} for d in prefill]},
                      "decode": {"workers": [{"dtype": d} for d in decode]}}}


def test_one_dtype_everywhere_or_each_pools_own():
    assert _dtypes(_status(["bfloat16"], ["bfloat16", "bfloat16"])) == "bfloat16 on every worker"
    assert _dtypes(_status(["float32"], ["bfloat16"])) == "prefill float32, decode bfloat16"
    assert _dtypes(_status(["float32", "bfloat16"], [])) == "prefill bfloat16/float32, decode -"


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_threads_follow_rays_cpu_assignment(monkeypatch, restore_threads):
    import ray

    for assigned, expected in ((3.0, 3), (0.5, 1), (0, 1)):
        context = types.SimpleNamespace(get_assigned_resources=lambda a=assigned: {"CPU": a} if a else {})
        monkeypatch.setattr(ray, "get_runtime_context", lambda c=context: c)
        assert actors._pin_threads(None) == expected
        assert torch.get_num_threads() == expected


def test_threads_follow_a_pinned_affinity(monkeypatch, restore_threads):
    pinned = []
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cores: pinned.append(cores))
    assert actors._pin_threads([0, 1]) == 2
    assert torch.get_num_threads() == 2 and pinned == [{0, 1}]
