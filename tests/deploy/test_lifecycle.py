"""A foreground `pdserve up` (what `make serve` runs) ends with its service, and its teardown
stops the Ray it started and no other: found by running `make serve` in one shell and
`pdserve down` in another, which left the foreground process spinning, and whose eventual
Ctrl-C ran `ray stop --force` on a different pdserve started meanwhile."""

import signal

import pytest

from pdserve.testkit.workers import free_port
from tests.deploy.cli import ForegroundUp, pdserve, recorded_ray, up_args
from tests.e2e.http import post

pytestmark = pytest.mark.slow


def completes(port: int) -> bool:
    status, body, _ = post(f"http://127.0.0.1:{port}/v1/completions",
                           {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}, timeout=60)
    return status == 200 and body["usage"]["completion_tokens"] == 2


def test_foreground_up_exits_when_down_runs_in_another_shell(tiny_llama_dir, tmp_path):
    up = ForegroundUp(tmp_path, tiny_llama_dir, free_port())
    try:
        up.wait_serving()
        local_ray = recorded_ray(tmp_path)
        down = pdserve(tmp_path, "down")
        assert down.returncode == 0, down.stderr[-2000:]
        assert up.wait_exit(60) == 0
        assert "the service was taken down" in up.log() or "Ray cluster" in up.log(), up.log()[-2000:]
        assert not local_ray.processes()
    finally:
        up.kill()


def test_foreground_up_exits_when_its_cluster_goes(tiny_llama_dir, tmp_path):
    up = ForegroundUp(tmp_path, tiny_llama_dir, free_port())
    try:
        up.wait_serving()
        recorded_ray(tmp_path).stop()  # every process of its Ray cluster, as a crash or `ray stop` would
        assert up.wait_exit(60) == 0
        assert "its Ray cluster" in up.log(), up.log()[-2000:]
    finally:
        up.kill()


def test_teardown_stops_only_the_ray_it_started(tiny_llama_dir, tmp_path):
    first_dir, other_dir = tmp_path / "first", tmp_path / "other"
    first_dir.mkdir()
    other_dir.mkdir()
    first = ForegroundUp(first_dir, tiny_llama_dir, free_port())
    other_port = free_port()
    try:
        first.wait_serving()
        first_ray = recorded_ray(first_dir)
        started = pdserve(other_dir, *up_args(tiny_llama_dir, other_port), "--detach")
        assert started.returncode == 0, started.stderr[-3000:]
        other_ray = recorded_ray(other_dir)
        assert other_ray != first_ray
        first.proc.send_signal(signal.SIGTERM)  # Ctrl-C's twin
        assert first.wait_exit(120) == 0, first.log()[-2000:]
        assert not first_ray.processes(), "the first service's Ray outlived its teardown"
        assert other_ray.running() and completes(other_port), "the first teardown stopped another pdserve's Ray"
    finally:
        first.kill()
        pdserve(other_dir, "down")
