"""Closed by default: real worker processes refuse every RPC without the cluster token (or
with a wrong one) and change nothing; workers refuse to start without a token; TLS works."""

import asyncio
import os
import subprocess
import sys
import time

import grpc
import pytest

from pdserve.protos import pdserve_pb2 as pb
from pdserve.protos import pdserve_pb2_grpc as pb_grpc
from pdserve.rpc.security import Security
from pdserve.testkit.workers import (
    ROOT,
    SECURITY,
    WorkerProcess,
    collect,
    decode_stub,
    generate_request,
    prefill_stub,
    wait_idle,
)

WRONG = Security("not-the-cluster-token-" + "x" * 10)
PROMPT = list(range(5, 45))


def stranger(kind: str, address: str, credentials: Security | None):
    """A stub with the wrong token, or (None) a plain channel that sends none at all."""
    if credentials is not None:
        return (decode_stub if kind == "decode" else prefill_stub)(address, credentials)
    channel = grpc.aio.insecure_channel(address)
    stub_class = pb_grpc.DecodeWorkerStub if kind == "decode" else pb_grpc.PrefillWorkerStub
    return channel, stub_class(channel)


@pytest.fixture(scope="module")
def pair(tiny_llama_dir):
    with WorkerProcess("prefill", str(tiny_llama_dir)) as p, WorkerProcess("decode", str(tiny_llama_dir)) as d:
        yield p, d


def _refused(exc_info) -> bool:
    return exc_info.value.code() == grpc.StatusCode.UNAUTHENTICATED


OURS_TOKENS = 128  # decode steps enough for the Abort and two Stats calls to land among them


async def wait_running(stub, request: asyncio.Future, timeout_s: float = 60.0) -> None:
    """Until the decode worker's Stats show a request in its batch (ours: the only one)."""
    deadline = time.monotonic() + timeout_s
    while not (await stub.Stats(pb.StatsRequest())).num_running:
        assert not request.done(), f"our request ended before it was seen running: {request.result()}"
        assert time.monotonic() < deadline, f"our request was not running on the decode worker after {timeout_s} s"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("bad", [WRONG, None], ids=["wrong-token", "no-token"])
def test_decode_worker_refuses_every_rpc_and_changes_nothing(pair, bad):
    prefill, decode = pair

    async def scenario():
        good_channel, good = decode_stub(decode.address)
        bad_channel, intruder = stranger("decode", decode.address, bad)
        async with good_channel, bad_channel:
            before = await good.Stats(pb.StatsRequest())
            for call in (intruder.Info(pb.InfoRequest()), intruder.Stats(pb.StatsRequest()),
                         intruder.Abort(pb.AbortRequest(request_id="r"))):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call
                assert _refused(refused)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await collect(intruder, generate_request("stranger", PROMPT, 4, [prefill.address]))
            assert _refused(refused)
            # a long request of ours, which a stranger's Abort must not end: it is sent while
            # ours is decoding, and ours is still decoding after it was refused
            ours = asyncio.ensure_future(collect(good, generate_request("ours", PROMPT, OURS_TOKENS,
                                                                        [prefill.address])))
            await wait_running(good, ours)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await intruder.Abort(pb.AbortRequest(request_id="ours"))
            assert _refused(refused)
            still_running = (await good.Stats(pb.StatsRequest())).num_running
            assert still_running and not ours.done(), "our request ended before the stranger's Abort was refused"
            tokens, finish, _ = await ours
            after = await wait_idle(good)
            return before, after, tokens, finish

    before, after, tokens, finish = asyncio.run(scenario())
    assert finish == "length" and len(tokens) == OURS_TOKENS, "a refused Abort ended our request"
    assert after.num_finished == before.num_finished + 1, "the stranger's Generate ran"
    assert after.num_free_blocks == after.num_total_blocks


@pytest.mark.parametrize("bad", [WRONG, None], ids=["wrong-token", "no-token"])
def test_prefill_worker_refuses_every_rpc(pair, bad):
    prefill, _ = pair

    async def scenario():
        channel, intruder = stranger("prefill", prefill.address, bad)
        async with channel:
            for call in (intruder.Info(pb.InfoRequest()), intruder.Stats(pb.StatsRequest()),
                         intruder.Abort(pb.AbortRequest(request_id="r"))):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call
                assert _refused(refused)
            # The stream is refused on its headers, before any message: wait for that status,
            # then try to send a start anyway. (Sending the start with the headers races the
            # refusal; the client may then report its failed send as INTERNAL.)
            stream = intruder.Prefill()
            assert await asyncio.wait_for(stream.code(), 30) == grpc.StatusCode.UNAUTHENTICATED
            start = pb.PrefillClientMessage(start=pb.PrefillRequest(request_id="s", prompt_token_ids=PROMPT))
            with pytest.raises((grpc.aio.AioRpcError, asyncio.InvalidStateError)):
                await stream.write(start)
        good_channel, good = prefill_stub(prefill.address)
        async with good_channel:
            return await good.Stats(pb.StatsRequest())

    stats = asyncio.run(scenario())
    assert stats.num_free_blocks == stats.num_total_blocks and not stats.num_waiting and not stats.num_running


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_worker_without_a_cluster_token_refuses_to_start(role, tiny_llama_dir):
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_CLUSTER_TOKEN"}
    result = subprocess.run([sys.executable, "-m", f"{role}_worker", "--model", str(tiny_llama_dir)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "no cluster token" in result.stderr and "PDSERVE_CLUSTER_TOKEN" in result.stderr


def _self_signed(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


@pytest.mark.skipif(subprocess.run(["which", "openssl"], capture_output=True).returncode != 0,
                    reason="needs the openssl command to make a test certificate")
def test_tls_between_router_side_decode_and_prefill(tiny_llama_dir, tmp_path):
    cert, key = _self_signed(tmp_path)
    tls = ("--tls-cert", str(cert), "--tls-key", str(key))
    secure = Security(SECURITY.cluster_token, str(cert), str(key))
    with WorkerProcess("prefill", str(tiny_llama_dir), *tls) as p, \
            WorkerProcess("decode", str(tiny_llama_dir), *tls) as d:

        async def scenario():
            channel, stub = decode_stub(d.address, secure)
            async with channel:
                result = await collect(stub, generate_request("tls", PROMPT, 6, [p.address]))
            plain_channel, plain = decode_stub(d.address)  # the right token, but no TLS
            async with plain_channel:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await plain.Info(pb.InfoRequest(), timeout=5)
            return result, refused.value.code()

        (tokens, finish, prefilled_by), plain_code = asyncio.run(scenario())
    assert finish == "length" and len(tokens) == 6
    assert prefilled_by not in ("", "local"), "the decode worker must reach the prefill worker over TLS"
    assert plain_code == grpc.StatusCode.UNAVAILABLE


@pytest.mark.skipif(subprocess.run(["which", "openssl"], capture_output=True).returncode != 0,
                    reason="needs the openssl command to make a test certificate")
def test_router_serves_https(tmp_path, smollm2_dir):
    import ssl
    import time
    import urllib.error
    import urllib.request

    from pdserve.testkit.workers import CLUSTER_TOKEN, free_port

    cert, key = _self_signed(tmp_path)
    port = free_port()
    router = subprocess.Popen([sys.executable, "-m", "pdserve.router", "--model", str(smollm2_dir), "--port", str(port),
                               "--decode", "127.0.0.1:1", "--https-cert", str(cert), "--https-key", str(key)],
                              cwd=ROOT, env={**os.environ, "PDSERVE_CLUSTER_TOKEN": CLUSTER_TOKEN},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    context = ssl.create_default_context(cafile=str(cert))
    try:
        deadline, answer = time.monotonic() + 60, None
        while answer is None and time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"https://127.0.0.1:{port}/health", context=context, timeout=2)
            except urllib.error.HTTPError as exc:  # 503: serving, no decode worker yet
                answer = exc.code
            except OSError:
                time.sleep(0.2)
        assert answer == 503, "the router did not answer over verified HTTPS"
        with pytest.raises(OSError):  # plain HTTP on the same port is not served
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        router.terminate()
        router.wait(15)
