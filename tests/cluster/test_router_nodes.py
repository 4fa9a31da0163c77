"""Router replicas on nodes of their own (`router.resources: {router: 1}`, `router.host:
null`; a simulated deployment on a multi-node Ray on this host, testkit/nodes.py): each
replica runs on a different router node and listens on that node's address, and answers
there; nginx and HAProxy, configured from deploy/nginx-router.conf and
deploy/haproxy-router.cfg, reach both replicas and pass a stream through unbuffered; a router
node removed leaves the other replica serving, the lost replica's start fails naming the
resource while no router node has room, and it starts by itself on a router node that
joins. The tests run in this order on one cluster."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from pdserve.engine.config import SIM_MODEL
from pdserve.router.config import RouterSettings
from pdserve.testkit.nodes import Nodes
from pdserve.testkit.workers import free_port
from tests.e2e.conftest import start_service, stop_service
from tests.e2e.http import parse_sse
from tests.e2e.test_router_replicas import complete_once, inflight, replicas, served

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
ROUTER = {"router": 1}  # what each router node offers, and each replica needs: one replica per node
ROUTER_NODES = {"router-a": "127.0.0.6", "router-b": "127.0.0.7"}
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def nodes():
    """head (the controller and both pools); two router nodes, room for one replica each and
    no CPU, so that no worker lands there."""
    cluster = Nodes()
    for name, ip in ROUTER_NODES.items():
        cluster.add(name, ip, num_cpus=0, resources=ROUTER)
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def service(nodes):
    controller, url = start_service(SIM_MODEL, served_model_name=None, **{
        "router.replicas": len(ROUTER_NODES), "router.resources": ROUTER, "router.host": None,
        "worker_host": None, "prefill.num_cpus": 0.1, "decode.num_cpus": 0.1,
        "sim.speed": 0.25})  # slower steps: a stream lasts long enough to be watched mid-way
    yield {"controller": controller, "url": url}
    stop_service(controller)


def status(service) -> dict:
    import ray

    return ray.get(service["controller"].status.remote(), timeout=60)


def wait_for(what: str, condition, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting until {what}"
        time.sleep(0.5)
    return value


def answered_by(handle, url: str) -> None:
    """A completion sent to `url` is answered, and counted by the replica `handle`."""
    before = served({0: handle})[0]
    complete_once(url)
    assert served({0: handle})[0] == before + 1


def test_each_replica_runs_on_its_own_router_node_and_answers_on_its_address(nodes, service):
    now = status(service)
    routers = now["routers"]
    assert [r["state"] for r in routers] == ["ready"] * len(ROUTER_NODES)
    assert sorted(nodes.name_of(r["node"]) for r in routers) == sorted(ROUTER_NODES), "one replica per router node"
    assert now["router"] == service["url"] == routers[0]["address"]  # what `pdserve up` prints: replica 0's
    handles = replicas(service["controller"])
    for r in routers:
        assert urlsplit(r["address"]).hostname == r["node"]
        answered_by(handles[r["replica"]], r["address"])


def configured(template: Path, upstreams: list[str], listen: str) -> str:
    """A load balancer's config from its deploy/ template: the template's example router
    addresses (10.0.0.x:8000, one `server` line each) become `upstreams`, and its listening
    port 8080 `listen`."""
    text = template.read_text()
    examples = re.findall(r"\b10\.0\.0\.\d+:8000\b", text)
    assert len(examples) == len(upstreams), "the template lists one server per router node"
    for example, upstream in zip(examples, upstreams, strict=True):
        text = text.replace(example, upstream)
    text, listens = re.subn(r"\b(listen|bind) \S*8080\b", lambda m: f"{m[1]} {listen}", text)
    assert listens == 1
    return text


def nginx_args(site: str, prefix: Path) -> list[str]:
    """nginx's arguments: in the foreground, one process, every path under `prefix`, serving
    `site` (the http-level snippet deploy/nginx-router.conf is) as /etc/nginx/conf.d would."""
    (prefix / "site.conf").write_text(site)
    temp_paths = " ".join(f"{kind}_temp_path {prefix / kind};"
                          for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    (prefix / "nginx.conf").write_text(
        f"daemon off; master_process off; pid {prefix / 'nginx.pid'}; error_log stderr warn;\n"
        f"events {{}}\nhttp {{ access_log off; {temp_paths} include {prefix / 'site.conf'}; }}\n")
    return ["-e", "stderr", "-p", str(prefix), "-c", str(prefix / "nginx.conf")]


def haproxy_args(config: str, prefix: Path) -> list[str]:
    """haproxy's arguments: in the foreground, its config file under `prefix`."""
    (prefix / "haproxy.cfg").write_text(config)
    return ["-db", "-f", str(prefix / "haproxy.cfg")]


BALANCERS = {"nginx": ("nginx-router.conf", nginx_args), "haproxy": ("haproxy-router.cfg", haproxy_args)}


def executable(name: str) -> str | None:
    """`name`'s path: on PATH, or in /usr/sbin, where Debian puts both balancers."""
    sbin = Path("/usr/sbin") / name
    return shutil.which(name) or (str(sbin) if sbin.exists() else None)


def healthy(url: str, process: subprocess.Popen, log: Path) -> bool:
    """Whether `url`/health answers 200; fails, with its output, once `process` has exited."""
    assert process.poll() is None, f"it exited: {log.read_text()}"
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.fixture(params=sorted(BALANCERS))
def balancer(request, service, tmp_path):
    """The load balancer `request.param` in front of the replicas, on a free port; its URL."""
    template, args = BALANCERS[request.param]
    path = executable(request.param)
    if path is None:
        pytest.skip(f"{request.param} is not installed (.ci/run installs it: apt-get install {request.param})")
    upstreams = [urlsplit(r["address"]).netloc for r in status(service)["routers"]]
    listen = f"127.0.0.1:{free_port()}"
    argv = [path, *args(configured(DEPLOY / template, upstreams, listen), tmp_path)]
    log = tmp_path / "balancer.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(f"{request.param} serves /health", lambda: healthy(f"http://{listen}", process, log), timeout_s=60)
        yield f"http://{listen}"
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_a_load_balancer_reaches_both_replicas_and_streams_unbuffered(service, balancer):
    handles = replicas(service["controller"])
    before = served(handles)
    sent = 2 * len(handles)
    for _ in range(sent):  # one at a time: least connections falls back to taking turns
        complete_once(balancer)
    gained = {i: n - before[i] for i, n in served(handles).items()}
    assert sum(gained.values()) == sent and all(gained.values()), gained

    body = {"model": SIM_MODEL, "prompt": [11, 12, 13, 14, 15], "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(balancer + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        first = response.readline()
        while not first.startswith(b"data: "):
            first = response.readline()
        # unbuffered: the first event reached the client while its replica still streams
        open_then = sum(inflight(h) for h in handles.values())
        rest = response.read().decode()
    assert open_then == 1
    events, done = parse_sse(first.decode() + rest)
    assert done and events[-1]["usage"]["completion_tokens"] == MAX_TOKENS


def router_events(service, since: float) -> list[dict]:
    return [e for e in status(service)["events"] if e["role"] == "router" and e["time"] >= since]


def test_a_router_node_removed_leaves_the_other_serving_and_its_replica_returns_on_a_new_node(nodes, service):
    routers = {r["replica"]: r for r in status(service)["routers"]}
    survivor, lost = routers[0], routers[1]
    handles = replicas(service["controller"])
    since = time.time()
    nodes.remove(nodes.name_of(lost["node"]))
    answered_by(handles[0], survivor["address"])

    needs = str(dict(RouterSettings(resources=ROUTER).resources))  # as the controller names them
    failed = wait_for("the lost replica's start fails: no router node has room", lambda: [
        e["detail"] for e in router_events(service, since) if e["event"] == "start_failed"], timeout_s=180)
    assert f"no node offers {needs} with room" in failed[0] and "deploy/nodes.yaml" in failed[0], failed
    assert "died" in [e["event"] for e in router_events(service, since)]
    now = status(service)
    assert [r["replica"] for r in now["routers"] if r["state"] == "ready"] == [0] and now["router_target"] == 2
    assert now["router"] == service["url"]
    answered_by(handles[0], survivor["address"])  # serving throughout

    nodes.add("router-c", "127.0.0.8", num_cpus=0, resources=ROUTER)  # an operator's new router node
    back = wait_for("replica 1 runs on the new router node", lambda: [
        r for r in status(service)["routers"] if r["replica"] == 1 and r["state"] == "ready"], timeout_s=180)
    assert back[0]["node"] == "127.0.0.8" and urlsplit(back[0]["address"]).hostname == "127.0.0.8"
    answered_by(replicas(service["controller"])[1], back[0]["address"])
