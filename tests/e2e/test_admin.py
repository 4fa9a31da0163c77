"""The operator endpoints over HTTP on a real cluster: the admin token is checked before the
body is read (401 whatever the body), and with it `/admin/scale` resizes a pool.
(Without a configured token they answer 403: tests/integration/test_bare_router.py.)"""

import json
import time

import pytest

from tests.e2e.conftest import start_service, stop_service
from tests.e2e.http import get, post

TOKEN = "admin-token-for-e2e"
RIGHT = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def admin(ray_cluster, tiny_llama_dir):
    controller, url = start_service(tiny_llama_dir, **{"router.admin_token": TOKEN})
    yield controller, url
    stop_service(controller)


def pools(controller) -> dict:
    import ray

    return ray.get(controller.status.remote())["pools"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                                     {"Authorization": f"Basic {TOKEN}"}], ids=["none", "wrong", "bare", "basic"])
@pytest.mark.parametrize("body", ["{not json", {"decode": 0}, {"decode": 2}], ids=["malformed", "invalid", "valid"])
def test_scale_without_the_right_token_is_401_and_changes_nothing(admin, headers, body):
    controller, url = admin
    status, out, response_headers = post(url + "/admin/scale", body, headers)
    assert status == 401, out  # not 422: the body of an unauthorised request is never parsed
    assert "bearer token" in out["error"]["message"] and out["error"]["type"] == "authentication_error"
    status, text = get(url + "/admin/status", headers)
    assert status == 401, text
    assert {role: (p["target"], len(p["workers"])) for role, p in pools(controller).items()} == \
        {"prefill": (1, 1), "decode": (1, 1)}


def test_scale_with_the_token_resizes_the_pool(admin):
    controller, url = admin
    status, out, _ = post(url + "/admin/scale", "{not json", RIGHT)
    assert status == 422, out  # authorised: now the body is parsed and named
    status, out, _ = post(url + "/admin/scale", {"decode": 0}, RIGHT)
    assert status == 422 and "decode" in out["error"]["message"], out

    status, out, _ = post(url + "/admin/scale", {"decode": 2}, RIGHT)
    assert status == 200 and out == {"prefill": 1, "decode": 2}, out
    status, text = get(url + "/admin/status", RIGHT)
    assert status == 200
    decode = json.loads(text)["pools"]["decode"]
    assert decode["target"] == 2 and [w["state"] for w in decode["workers"]] == ["ready", "ready"], decode
    assert [w["state"] for w in pools(controller)["decode"]["workers"]] == ["ready", "ready"]
    deadline = time.monotonic() + 10  # the router learns membership every 0.5 s
    while (health := json.loads(get(url + "/health")[1]))["decode_workers"] != 2:
        assert time.monotonic() < deadline, health
        time.sleep(0.2)

    status, out, _ = post(url + "/admin/scale", {"decode": 1}, RIGHT)
    assert status == 200 and out == {"prefill": 1, "decode": 1}, out
    assert len(pools(controller)["decode"]["workers"]) == 1
    status, out, _ = post(url + "/v1/completions", {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3})
    assert status == 200 and out["usage"]["completion_tokens"] == 3, out
