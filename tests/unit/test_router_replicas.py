"""Router replicas: the `router.replicas` setting and its flags (`pdserve up/scale --routers`,
the bare router's), the SO_REUSEPORT socket every replica binds, the replicas' actor names,
and the merge of every replica's observations for the autoscaler."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time

import pytest

from pdserve.cluster.actors import merge_observations
from pdserve.cluster.cli import build_parser as pdserve_parser
from pdserve.cluster.cli_service import _overrides, print_status
from pdserve.cluster.config import load_config
from pdserve.cluster.recovery import ROUTER_NAME, router_name, router_replica
from pdserve.router.config import RouterConfig, RouterSettings
from pdserve.router.registry import static_source
from pdserve.router.server import build_parser, ensure_port_free, make_server, router_config_from_args, shared_socket
from pdserve.router.state import FinishedRequest, Router
from pdserve.rpc.security import Security
from tests.unit.test_settings_declared_once import written_in

TOKEN = "t" * 32


def test_replicas_default_to_one_and_are_set_in_yaml_or_by_flag(tmp_path):
    assert RouterSettings().replicas == 1 and load_config(None).router.replicas == 1
    path = tmp_path / "model.yaml"
    path.write_text("router:\n  port: 8100\n  replicas: 3\n")
    assert load_config(path).router.replicas == 3
    args = pdserve_parser().parse_args(["up", "--routers", "2"])
    assert load_config(path, _overrides(args)).router.replicas == 2
    assert load_config(path, _overrides(pdserve_parser().parse_args(["up"]))).router.replicas == 3  # unset: YAML's
    scale = pdserve_parser().parse_args(["scale", "--routers", "4"])
    assert scale.routers == 4 and scale.prefill is None and scale.decode is None
    assert load_config(None, {"cluster_token": TOKEN, "router.replicas": 2}).router_config().replicas == 2


def test_bad_replicas_are_named():
    with pytest.raises(ValueError, match="router.replicas: Input should be greater than or equal to 1"):
        load_config(None, {"router.replicas": 0})
    with pytest.raises(ValueError, match="give a port other than 0"):
        load_config(None, {"router.replicas": 2, "router.port": 0})
    with pytest.raises(ValueError, match="--routers: Input should be greater than or equal to 1"):
        router_config_from_args(build_parser().parse_args(["--decode", "h:1", "--routers", "0",
                                                           "--cluster-token", TOKEN]))


def test_the_routers_flag_is_derived_from_the_field_not_written_by_hand():
    config = router_config_from_args(build_parser().parse_args(["--decode", "h:1", "--routers", "2",
                                                                "--cluster-token", TOKEN]))
    assert config.replicas == 2
    # the declaration's json_schema_extra is its one mention: pdserve up/scale read it from there
    assert written_in("--routers") == ["router/config.py"]


def test_replica_names():
    assert router_name(0) == ROUTER_NAME and router_name(3) == f"{ROUTER_NAME}-3"
    assert [router_replica(router_name(i)) for i in range(4)] == [0, 1, 2, 3]
    assert router_replica("pdserve-worker-decode-abc") is None and router_replica(f"{ROUTER_NAME}-x") is None


def _connect_and_talk(port: int, payload: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
        client.sendall(payload)


def test_two_sockets_bound_to_one_port_both_accept_connections():
    first = shared_socket("127.0.0.1", 0)
    port = first.getsockname()[1]
    second = shared_socket("127.0.0.1", port)
    try:
        assert second.getsockname()[1] == port
        for sock in (first, second):
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 1
            sock.settimeout(0.05)
        accepted = {0: 0, 1: 0}
        for i in range(64):  # the kernel hashes each connection's addresses to one of the two
            _connect_and_talk(port, b"hello %d" % i)
            for k, sock in enumerate((first, second)):
                try:
                    conn, _ = sock.accept()
                except TimeoutError:
                    continue
                with conn:
                    assert conn.recv(16).startswith(b"hello")
                accepted[k] += 1
        assert accepted[0] > 0 and accepted[1] > 0 and sum(accepted.values()) == 64, accepted
    finally:
        first.close()
        second.close()


def test_a_plain_bind_of_a_shared_port_is_still_refused():
    shared = shared_socket("127.0.0.1", 0)
    try:
        with socket.socket() as plain, pytest.raises(OSError):
            plain.bind(("127.0.0.1", shared.getsockname()[1]))
    finally:
        shared.close()


def _config(port: int, replicas: int, model: str = "m") -> RouterConfig:
    return RouterConfig(model=model, port=port, replicas=replicas, security=Security(TOKEN))


def test_two_routers_with_replicas_share_their_port_and_one_router_binds_it_alone(smollm2_dir):
    """Two routers' uvicorn servers started with replicas 2 serve one port, each answering
    some of the connections; with replicas 1 a router on a taken port fails to start, as before."""

    def router(port: int, replicas: int):
        return make_server(_config(port, replicas, str(smollm2_dir)),
                           static_source([], ["127.0.0.1:1"], Security(TOKEN)))

    async def main():
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        servers = [router(port, 2) for _ in range(2)]
        tasks = [asyncio.create_task(s.serve()) for s in servers]
        try:
            deadline = time.monotonic() + 30
            while not all(s.started for s in servers):
                assert time.monotonic() < deadline and not any(t.done() for t in tasks), [t for t in tasks if t.done()]
                await asyncio.sleep(0.05)
            for _ in range(32):  # a new connection each: the kernel spreads them
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                assert (await reader.read()).startswith(b"HTTP/1.1 200")
                writer.close()
            served = [s.server_state.total_requests for s in servers]
            assert all(n > 0 for n in served) and sum(served) == 32, served
            with pytest.raises(SystemExit):  # uvicorn's "address already in use"
                await router(port, 1).serve()
        finally:
            for s in servers:
                s.should_exit = True
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())


def test_a_services_first_replica_binds_its_port_shared_so_that_replicas_can_join_it_later(smollm2_dir):
    """The controller runs every router as a numbered replica: replica 0 of a one-replica
    service binds the port shared, so `scale --routers 2` can add replica 1; the service's
    start probes the port instead (`ensure_port_free`), so a port in use still fails it."""

    def replica(port: int, number: int):
        config = _config(port, 1, str(smollm2_dir)).model_copy(update={"replica": number})
        return make_server(config, static_source([], ["127.0.0.1:1"], Security(TOKEN)))

    async def main():
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        ensure_port_free("127.0.0.1", port)
        first = replica(port, 0)
        servers, tasks = [first], [asyncio.create_task(first.serve())]
        try:
            while not first.started:
                assert not tasks[0].done(), tasks[0]
                await asyncio.sleep(0.05)
            with pytest.raises(RuntimeError, match=f"port 127.0.0.1:{port} is in use"):
                ensure_port_free("127.0.0.1", port)
            second = replica(port, 1)  # joins the one already serving
            servers.append(second)
            tasks.append(asyncio.create_task(second.serve()))
            deadline = time.monotonic() + 30
            while not second.started:
                assert time.monotonic() < deadline and not tasks[1].done(), tasks[1]
                await asyncio.sleep(0.05)
        finally:
            for server in servers:
                server.should_exit = True
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())


def _request(end: float, ttft: float, tpot: float | None, prompt: int = 10, cached: int = 0) -> FinishedRequest:
    return FinishedRequest(end=end, prompt_tokens=prompt, completion_tokens=5, ttft_s=ttft, tpot_s=tpot,
                           cached_tokens=cached, arrival=end - 1)


def _samples(requests: list[FinishedRequest], inflight: int = 0) -> dict:
    return {"finished": [dataclasses.astuple(r) for r in requests], "inflight": inflight}


def test_one_replicas_merged_observations_are_the_routers_own():
    now = time.monotonic()
    router = Router(_config(8000, 1), registry=None)
    router.finished.extend(_request(now - 0.1 * i, ttft=0.01 * i, tpot=None if i % 3 else 0.002 * i, cached=i)
                           for i in range(40, 0, -1))
    router.inflight = 3
    merged = merge_observations([_samples(list(router.finished), router.inflight)], 30.0, 90.0)
    assert merged == router.observations(30.0, 90.0)


def test_replicas_observations_are_merged_from_their_samples_not_their_percentiles():
    now = time.monotonic()
    fast = [_request(now - 1 - i, ttft=0.1, tpot=0.01, prompt=100, cached=50) for i in range(9)]
    slow = [_request(now - 0.5, ttft=5.0, tpot=1.0, prompt=100, cached=0)]
    merged = merge_observations([_samples(fast, 2), _samples(slow, 1)], 10.0, 50.0)
    assert merged["count"] == 10 and merged["rate"] == 1.0 and merged["inflight"] == 3
    assert merged["ttft_p"] == pytest.approx(0.1)  # the median of all ten samples, not the mean of two medians
    assert merged["hit_rate"] == pytest.approx(450 / 1000)
    assert merged["arrivals"] == sorted(merged["arrivals"]) and len(merged["lengths"]) == 10


def test_replicas_observations_on_clocks_of_their_own_are_merged_on_one():
    """A replica on another node reports times of its own monotonic clock, with its `now`:
    the merge moves them onto the first part's clock, so arrivals interleave as they happened."""
    now = time.monotonic()
    here = [_request(now - 2, ttft=0.1, tpot=0.01), _request(now - 1, ttft=0.1, tpot=0.01)]
    elsewhere_offset = 5000.0  # that node's clock reads 5000 s more at the same instant
    there = [_request(now - 1.5 + elsewhere_offset, ttft=0.2, tpot=0.02)]
    merged = merge_observations([{**_samples(here), "now": now}, {**_samples(there), "now": now + elsewhere_offset}],
                                10.0, 50.0)
    assert merged["count"] == 3
    assert merged["arrivals"] == pytest.approx([now - 3, now - 2.5, now - 2])  # arrival = end - 1


def test_status_prints_one_line_per_router_replica(capsys):
    status = {"router": "http://127.0.0.1:8000", "model": "tiny", "simulated": None, "routing": None,
              "router_target": 2, "pools": {}, "events": [], "autoscaler": {"enabled": False},
              "routers": [{"replica": 0, "name": ROUTER_NAME, "address": "http://127.0.0.1:8000", "pid": 101,
                           "state": "ready"},
                          {"replica": 1, "name": f"{ROUTER_NAME}-1", "address": "http://127.0.0.1:8000", "pid": 102,
                           "state": "ready"}]}
    print_status(status)
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("  router ")]
    assert len(lines) == 2 and "pid     101" in lines[0] and f"{ROUTER_NAME}-1" in lines[1], out
    assert "router replicas: target 2, 2 running" in out
