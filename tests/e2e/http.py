"""Small HTTP helpers for the end-to-end tests (stdlib for plain calls, aiohttp for load)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request


def parse_sse(text: str) -> tuple[list[dict], bool]:
    """A whole server-sent-event stream: (the JSON payload of each `data:` event before
    `[DONE]`, whether `[DONE]` came). Raises on an event that is not JSON."""
    events = []
    for line in text.splitlines():
        if not line.startswith("data: "):
            continue
        payload = line[len("data: "):]
        if payload == "[DONE]":
            return events, True
        events.append(json.loads(payload))
    return events, False


def post(url: str, body, headers: dict | None = None, timeout: float = 120) -> tuple[int, dict, dict]:
    """POST JSON (or raw bytes/str); returns (status, parsed body, headers). A streaming
    answer (text/event-stream) is read to its end and parsed as {"events": [...], "done": bool}."""
    data = body if isinstance(body, bytes) else (body.encode() if isinstance(body, str) else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
            if response.headers.get_content_type() == "text/event-stream":
                events, done = parse_sse(raw.decode())
                return response.status, {"events": events, "done": done}, dict(response.headers)
            return response.status, json.loads(raw), dict(response.headers)
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            parsed = json.loads(raw)
        except json.JSONDecodeError:
            parsed = {"raw": raw.decode(errors="replace")}
        return exc.code, parsed, dict(exc.headers)


def get(url: str, headers: dict | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


ABORTED = 'pdserve_requests_total{finish_reason="abort"}'  # requests that ended because the client left


def metric(url: str, sample: str) -> float:
    """The value of one Prometheus sample of `url`/metrics, e.g.
    `pdserve_requests_total{finish_reason="abort"}` (0 when it has not been recorded yet)."""
    status, text = get(url + "/metrics")
    assert status == 200, text
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == sample:
            return float(value)
    return 0.0


async def stream(session, url: str, body: dict) -> tuple[list[dict], bool]:
    """POST a streaming request; returns (parsed events, saw [DONE])."""
    events, done = [], False
    async with session.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload == "[DONE]":
                done = True
                break
            events.append(json.loads(payload))
    return events, done
