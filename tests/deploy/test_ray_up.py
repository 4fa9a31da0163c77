"""`ray up deploy/cluster.yaml` for real, against this machine: an sshd on 127.0.0.1 with a
key of the test's own, Ray's local provider, requests through the router, `ray down`, and
no Ray process left afterwards."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.deploy.cli import ray_client
from tests.e2e.http import post

ROOT = Path(__file__).resolve().parent.parent.parent
HOME = Path.home()
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path(SSHD).exists() or not shutil.which("rsync"),
                       reason="needs openssh-server and rsync (.ci/run installs them)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the local provider logs in as root over ssh"),
]


def ray_node_ip() -> str:
    """The address `ray start` picks for this host (its route to the outside)."""
    from ray._private.services import node_ip_address_from_perspective

    return node_ip_address_from_perspective(None)


def ray_processes() -> list[str]:
    out = subprocess.run(["pgrep", "-af", "raylet|gcs_server"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


@pytest.fixture
def sshd(tmp_path):
    if not _port_free(22):
        pytest.skip("port 22 is taken on 127.0.0.1")
    if (HOME / "pdserve").exists():
        pytest.skip(f"{HOME / 'pdserve'} exists; the cluster mounts the checkout there")
    # `ray down` runs `ray stop`, which stops every Ray here: none may run (an earlier test's
    # leftovers get a moment to go, then are named)
    deadline = time.monotonic() + 30
    while ray_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not ray_processes(), f"a Ray is still running here: {ray_processes()}"
    key, host_key = tmp_path / "id", tmp_path / "host"
    for path in (key, host_key):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    (tmp_path / "authorized_keys").write_text((tmp_path / "id.pub").read_text())
    config = tmp_path / "sshd_config"
    config.write_text(f"Port 22\nListenAddress 127.0.0.1\nHostKey {host_key}\n"
                      f"AuthorizedKeysFile {tmp_path / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
                      f"PasswordAuthentication no\nStrictModes no\nUsePAM no\nPidFile {tmp_path / 'sshd.pid'}\n")
    Path("/run/sshd").mkdir(exist_ok=True)
    process = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stderr=open(tmp_path / "sshd.log", "w"))
    for _ in range(50):
        if not _port_free(22):
            break
        time.sleep(0.1)
    bashrc = HOME / ".bashrc"
    saved = bashrc.read_text() if bashrc.exists() else None
    yield key
    process.terminate()
    process.wait(10)
    if saved is None:
        bashrc.unlink(missing_ok=True)
    else:
        bashrc.write_text(saved)
    shutil.rmtree(HOME / "pdserve", ignore_errors=True)


def test_ray_up_serves_requests_and_ray_down_leaves_nothing(sshd, tmp_path):
    cluster = yaml.safe_load((ROOT / "deploy" / "cluster.yaml").read_text())
    assert cluster["provider"] == {"type": "local", "head_ip": "127.0.0.1", "worker_ips": []}
    cluster["auth"]["ssh_private_key"] = str(sshd)  # only the key differs from the shipped file
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump(cluster))
    ray = str(Path(sys.executable).parent / "ray")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_")}, "RAY_USAGE_STATS_ENABLED": "0"}
    # the operator's one step before `ray up`: Ray's token, which cluster.yaml copies to every node
    subprocess.run([ray, "get-auth-token", "--generate"], env=env, check=True, capture_output=True)
    try:
        up = subprocess.run([ray, "up", "-y", "--no-config-cache", str(config)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=1500)
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        deadline = time.monotonic() + 300
        status = None
        while time.monotonic() < deadline:
            status, body, _ = post("http://127.0.0.1:8000/v1/completions",
                                   {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is",
                                    "max_tokens": 5, "temperature": 0}, timeout=60)
            if status == 200:
                break
            time.sleep(2)
        assert status == 200, body
        assert "Paris" in body["choices"][0]["text"]
        assert body["usage"]["completion_tokens"] == 5
        head = f"{ray_node_ip()}:6379"  # the head listens on this host's address, as on a real cluster
        assert ray_client(head, RAY_AUTH_MODE="token") == "ACCEPTED 42"  # with the token cluster.yaml copied
        assert ray_client(head, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64) == "REFUSED"
        assert ray_client(head, RAY_AUTH_MODE="disabled") == "REFUSED"
    finally:
        down = subprocess.run([ray, "down", "-y", str(config)], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=300)
    assert down.returncode == 0, down.stdout[-2000:] + down.stderr[-2000:]
    deadline = time.monotonic() + 30
    while ray_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not ray_processes(), ray_processes()
