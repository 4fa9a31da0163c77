"""API keys on /v1 (vLLM's --api-key): refused without or with a wrong key, served with the
right one (the openai client included); /health stays open; /metrics only when asked; the
deployment's cluster token reaches every worker and never shows in the status an operator
reads."""

import asyncio
import json

import grpc
import pytest

from tests.e2e.conftest import start_service, stop_service
from tests.e2e.http import get, post

KEYS = ["key-one-0123456789", "key-two-0123456789"]
TOKEN = "e2e-cluster-token-0123456789abcdef"
BODY = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def keyed(ray_cluster, tiny_llama_dir):
    controller, url = start_service(tiny_llama_dir, **{"router.api_keys": KEYS, "cluster_token": TOKEN,
                                                        "router.metrics_require_key": True})
    yield controller, url
    stop_service(controller)


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"}, {"authorization": KEYS[0]},
                                     {"authorization": f"Basic {KEYS[0]}"}])
def test_v1_refuses_a_missing_or_wrong_key(keyed, headers):
    _, url = keyed
    status, body, response_headers = post(f"{url}/v1/completions", BODY, headers)
    assert status == 401
    assert body["error"]["type"] == "authentication_error" and "API key" in body["error"]["message"]
    assert response_headers.get("www-authenticate", response_headers.get("WWW-Authenticate")) == "Bearer"
    status, _ = get(f"{url}/v1/models", headers)
    assert status == 401


def test_malformed_body_without_a_key_is_refused_before_it_is_read(keyed):
    _, url = keyed
    status, body, _ = post(f"{url}/v1/completions", b"{not json")
    assert status == 401, body


@pytest.mark.parametrize("key", KEYS)
def test_v1_serves_each_configured_key(keyed, key):
    _, url = keyed
    status, body, _ = post(f"{url}/v1/completions", BODY, {"authorization": f"Bearer {key}"})
    assert status == 200 and body["usage"]["completion_tokens"] == 3


def test_openai_client_with_the_api_key(keyed):
    from openai import AuthenticationError, OpenAI

    _, url = keyed
    answer = OpenAI(base_url=f"{url}/v1", api_key=KEYS[1]).completions.create(
        model="tiny", prompt="Hello", max_tokens=2, temperature=0)
    assert answer.usage.completion_tokens == 2
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=f"{url}/v1", api_key="wrong").models.list()


def test_health_is_open_and_metrics_need_a_key_when_configured(keyed):
    _, url = keyed
    assert get(f"{url}/health")[0] == 200
    assert get(f"{url}/metrics")[0] == 401
    status, text = get(f"{url}/metrics", {"authorization": f"Bearer {KEYS[0]}"})
    assert status == 200 and "pdserve_" in text


def test_workers_take_the_deployments_token_which_status_never_shows(keyed):
    import ray

    from pdserve.protos import pdserve_pb2 as pb
    from pdserve.rpc.security import Security
    from pdserve.testkit.workers import decode_stub

    controller, url = keyed
    status = ray.get(controller.status.remote())
    assert TOKEN not in json.dumps(status, default=str)
    admin_status, admin_text = get(f"{url}/admin/status", {"authorization": "Bearer secret-token"})
    assert admin_status == 200 and TOKEN not in admin_text
    (address,) = [m["address"] for m in ray.get(controller.members.remote()) if m["role"] == "decode"]

    async def info(token: str):
        channel, stub = decode_stub(address, Security(token))
        async with channel:
            return await stub.Info(pb.InfoRequest(), timeout=5)

    assert asyncio.run(info(TOKEN)).role == "decode"
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        asyncio.run(info("some-other-token-0123456789"))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
