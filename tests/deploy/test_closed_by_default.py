"""Closed by default includes Ray. After `pdserve up` on one machine, with none of this test
session's Ray settings: every socket that any process of the service listens on (Ray's GCS,
raylet and agents, the controller, the workers, the router) is on a loopback address, as the
process table shows; a Ray client without the cluster's token is refused and one with it is
accepted; `pdserve status`, `scale`, `ray status` and `down` work from another shell with
the defaults; `down` leaves none of the cluster's processes."""

import ipaddress
import subprocess
import sys

import psutil
import pytest

from pdserve.testkit.workers import free_port
from tests.deploy.cli import operator_env, pdserve, ray_client, recorded_ray, up_args
from tests.e2e.http import post

pytestmark = pytest.mark.slow

def listening(processes) -> dict[tuple[str, int], str]:
    """(address, port) -> process name, for every listening TCP socket of `processes`."""
    pids = {p.pid: p for p in processes}
    found = {}
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in pids:
            found[(conn.laddr.ip, conn.laddr.port)] = pids[conn.pid].name()
    return found


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


@pytest.fixture
def service(tiny_llama_dir, tmp_path):
    port = free_port()
    up = pdserve(tmp_path, *up_args(tiny_llama_dir, port), "--detach")
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        yield tmp_path, port, recorded_ray(tmp_path)
    finally:
        pdserve(tmp_path, "down")


def test_every_socket_of_the_service_is_on_loopback(service):
    run_dir, port, local_ray = service
    status, body, _ = post(f"http://127.0.0.1:{port}/v1/completions", {"model": "tiny", "prompt": [5, 6, 7],
                                                                        "max_tokens": 3})
    assert status == 200, body  # the KV pair formed: its rendezvous store listens too
    sockets = listening(local_ray.processes())
    gcs_port = int(local_ray.address.rsplit(":", 1)[1])
    names = set(sockets.values())
    assert {"gcs_server", "raylet"} <= names and any(p == gcs_port for _, p in sockets), sockets
    assert any(p == port for _, p in sockets), f"the router's port {port} is not among {sockets}"
    exposed = {addr: name for addr, name in sockets.items() if not is_loopback(addr[0])}
    assert not exposed, f"listening beyond loopback: {exposed}"


def test_a_ray_client_needs_the_token(service):
    _, _, local_ray = service
    loopback = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # what `pdserve ray` sets for a loopback head
    assert ray_client(local_ray.address, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64, **loopback) == "REFUSED"
    assert ray_client(local_ray.address, RAY_AUTH_MODE="disabled", **loopback) == "REFUSED"
    assert ray_client(local_ray.address, RAY_AUTH_MODE="token", **loopback) == "ACCEPTED 42"  # ~/.ray/auth_token


def test_operator_commands_from_another_shell(service):
    run_dir, port, local_ray = service
    status = pdserve(run_dir, "status", "--json")
    assert status.returncode == 0, status.stderr[-2000:]
    assert f":{port}" in status.stdout and '"decode"' in status.stdout
    scaled = pdserve(run_dir, "scale", "--decode", "2")
    assert scaled.returncode == 0 and "decode 2" in scaled.stdout, scaled.stderr[-2000:]
    ray_status = pdserve(run_dir, "ray", "status")
    assert ray_status.returncode == 0 and "Active:" in ray_status.stdout, ray_status.stderr[-2000:]
    down = pdserve(run_dir, "down")
    assert down.returncode == 0 and "stopped the local Ray" in down.stdout, down.stderr[-2000:]
    assert not local_ray.processes(), "`pdserve down` left processes of its Ray cluster"
    assert not (run_dir / "local-ray.json").exists()


def test_auth_disabled_is_the_operators_choice_and_warned(tiny_llama_dir, tmp_path):
    """RAY_AUTH_MODE=disabled is honoured (never a default pdserve sets), with a warning."""
    env = {**operator_env(tmp_path), "RAY_AUTH_MODE": "disabled"}
    port = free_port()
    up = subprocess.run([sys.executable, "-m", "pdserve.cluster.cli", *up_args(tiny_llama_dir, port), "--detach"],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        assert "RAY_AUTH_MODE=disabled: Ray's token auth is off" in up.stderr
        assert "token auth OFF" in up.stderr
        local_ray = recorded_ray(tmp_path)
        assert ray_client(local_ray.address, RAY_AUTH_MODE="disabled", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0") \
            == "ACCEPTED 42"
    finally:
        subprocess.run([sys.executable, "-m", "pdserve.cluster.cli", "down"], cwd=tmp_path, env=env, timeout=300)
