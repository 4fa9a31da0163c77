"""The live dashboard (`/dashboard`) in a real browser: headless Chromium from the OS packages
driven by Selenium, against a real service on Ray. The numbers the page shows match what
/metrics exports; scaling the decode pool from the page is refused without the admin token
(the page says so) and works with it; a worker is drained from the page. The screenshot is
the README's (benchmarks/results/dashboard.png)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import start_service, stop_service
from tests.e2e.http import get, post

TOKEN = "dashboard-admin-token"
SCREENSHOT = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "dashboard.png"
PROMPT_PREFIX = list(range(100, 164))  # shared by every request: prefix-cache hits to show


def open_browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[dev]')")
    from selenium.webdriver.chrome.service import Service

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.skip("no headless Chromium: apt-get install chromium chromium-driver (.ci/run installs them)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1440,1000"):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=Service(executable_path=driver))


@pytest.fixture(scope="module")
def browser():
    driver = open_browser()  # before the service: skips cost nothing
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def service(browser, ray_cluster, tiny_llama_dir):
    controller, url = start_service(tiny_llama_dir, **{"router.admin_token": TOKEN})
    yield controller, url
    stop_service(controller)


def metrics(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    status, text = get(url + "/metrics")
    assert status == 200, text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def send_traffic(url: str, requests: int, seconds: float) -> int:
    """At least `requests` requests, and for at least `seconds` (the page samples meanwhile)."""
    sent, deadline = 0, time.monotonic() + seconds
    while sent < requests or time.monotonic() < deadline:
        body = {"model": "tiny", "prompt": PROMPT_PREFIX + [200 + sent % 50] * (5 + sent % 7), "max_tokens": 6,
                "ignore_eos": True, "stream": sent % 2 == 0}
        status, out, _ = post(url + "/v1/completions", body)
        assert status == 200, out
        sent += 1
    return sent


def wait_for(check, timeout_s: float = 30, what: str = "", seen: dict | None = None):
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        assert time.monotonic() < deadline, f"timed out waiting for {what}; last seen: {seen}"
        time.sleep(0.25)


def text(browser, css: str) -> str:
    """The text of the first element matching `css` ('' if none), read in one step: the page
    redraws its tables every refresh, which would make a found element stale."""
    return browser.execute_script("const e = document.querySelector(arguments[0]); return e ? e.textContent : ''",
                                  css).strip()


def attribute(browser, css: str, name: str) -> str | None:
    return browser.execute_script("const e = document.querySelector(arguments[0]); "
                                  "return e ? e.getAttribute(arguments[1]) : null", css, name)


def click(browser, css: str) -> bool:
    """Click the element the user sees at `css`; False if it is not there or was just redrawn."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.by import By

    try:
        browser.find_element(By.CSS_SELECTOR, css).click()
        return True
    except (NoSuchElementException, StaleElementReferenceException):  # not drawn yet, or just redrawn
        return False


def scale_from_page(browser, pool: str, n: int, token: str) -> None:
    from selenium.webdriver.common.by import By

    token_field = browser.find_element(By.ID, "admin-token")
    token_field.clear()
    if token:
        token_field.send_keys(token)
    size = browser.find_element(By.ID, f"scale-{pool}-input")
    size.clear()
    size.send_keys(str(n))
    browser.find_element(By.ID, f"scale-{pool}-button").click()


def pools(controller) -> dict:
    import ray

    return ray.get(controller.status.remote())["pools"]


def test_dashboard_shows_what_metrics_exports_and_scales_with_the_token(browser, service):
    controller, url = service
    browser.get(url + "/dashboard")
    wait_for(lambda: text(browser, "#updated") not in ("", "never"), what="the first refresh")
    assert text(browser, "#cluster-note") == ""  # it reached the controller

    sent = send_traffic(url, 10, 8.0)  # the page polls meanwhile: bandwidth is measured between its samples

    # the page refreshes itself; once the workers' next Stats are in, it shows what /metrics says
    seen = {}

    def agrees() -> bool:
        m = metrics(url)
        finished = sum(v for (name, _), v in m.items() if name == "pdserve_requests_total")
        shown = {"finished": text(browser, "#requests-total"),
                 "decode": text(browser, "#pool-decode-workers"), "prefill": text(browser, "#pool-prefill-workers")}
        hit_rates = {(key[1][0][1], key[1][1][1]): v for key, v in m.items()
                     if key[0] == "pdserve_worker_prefix_cache_hit_rate"}
        shown["hits"] = {(pool, worker): attribute(browser, f'tr[data-worker-id="{worker}"] td.hit-rate', "data-value")
                         for pool, worker in hit_rates}
        shown["hits"] = {k: float(v) if v else None for k, v in shown["hits"].items()}
        seen.update(page=shown, finished=finished, hit_rates=hit_rates, sent=sent,
                    pool_workers={k: v for k, v in m.items() if k[0] == "pdserve_pool_workers"})
        return (finished == sent and shown["finished"] == str(int(finished))
                and shown["decode"] == str(int(m["pdserve_pool_workers", (("pool", "decode"),)])) == "1"
                and shown["prefill"] == str(int(m["pdserve_pool_workers", (("pool", "prefill"),)])) == "1"
                and len(hit_rates) == 2 and any(v > 0 for v in hit_rates.values())
                and shown["hits"] == hit_rates)  # the exact number the page shows as a percentage

    wait_for(agrees, 60, what="the page to show the numbers of /metrics", seen=seen)
    data = json.loads(get(url + "/dashboard/data")[1])
    assert data["latency"]["overall"]["count"] == sent and data["slo"]["ttft_s"] > 0
    assert max(p["sent_bps"] for p in data["transfer"]) > 0, "KV bandwidth from the workers' byte counters"
    assert "p90" in text(browser, "#legend-ttft") and "SLO" in browser.find_element("id", "chart-ttft").get_attribute(
        "innerHTML")

    # without the token the page's scale is refused, and says so; nothing changes
    scale_from_page(browser, "decode", 2, token="")
    wait_for(lambda: "refused (401)" in text(browser, "#admin-message"), what="the refusal")
    assert "bearer token" in text(browser, "#admin-message")
    scale_from_page(browser, "decode", 2, token="not-the-token")
    wait_for(lambda: "refused (401)" in text(browser, "#admin-message"), what="the refusal of a wrong token")
    assert pools(controller)["decode"]["target"] == 1 and len(pools(controller)["decode"]["workers"]) == 1

    # with it, the decode pool grows to 2 and the page and /metrics both show it
    scale_from_page(browser, "decode", 2, token=TOKEN)
    wait_for(lambda: "pools now prefill 1, decode 2" in text(browser, "#admin-message"), 180, "the scale to finish")
    wait_for(lambda: text(browser, "#pool-decode-workers") == "2" and text(browser, "#pool-decode-target") == "2",
             what="two routable decode workers on the page")
    assert metrics(url)["pdserve_pool_workers", (("pool", "decode"),)] == 2
    assert [w["state"] for w in pools(controller)["decode"]["workers"]] == ["ready", "ready"]

    browser.execute_script("window.scrollTo(0, 0)")
    for _ in range(3):  # the window's height includes the browser's own bars: grow it until the page fits
        missing = browser.execute_script("return document.documentElement.scrollHeight - window.innerHeight")
        if missing <= 0:
            break
        browser.set_window_size(1440, browser.get_window_size()["height"] + missing + 10)
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(SCREENSHOT)) and SCREENSHOT.stat().st_size > 10_000


def test_drain_from_the_page_needs_the_token_and_replaces_the_worker(browser, service):
    from selenium.webdriver.common.by import By

    controller, url = service
    decode = [w["worker_id"] for w in pools(controller)["decode"]["workers"] if w["state"] == "ready"]
    status, out, _ = post(url + "/admin/drain", {"worker_id": decode[0]})
    assert status == 401, out
    status, out, _ = post(url + "/admin/drain", {"worker_id": "no-such-worker"},
                          {"Authorization": f"Bearer {TOKEN}"})
    assert status == 404 and "no-such-worker" in out["error"]["message"], out

    browser.get(url + "/dashboard")
    browser.find_element(By.ID, "admin-token").send_keys(TOKEN)
    wait_for(lambda: click(browser, f'button.drain[data-worker-id="{decode[0]}"]'), what="the drain button")
    wait_for(lambda: f"{decode[0]} is draining" in text(browser, "#admin-message"), what="the drain to start")

    def replaced() -> bool:
        workers = pools(controller)["decode"]["workers"]
        return decode[0] not in {w["worker_id"] for w in workers} and [w["state"] for w in workers] == ["ready"] * 2

    wait_for(replaced, 180, "the drained worker to stop and its replacement to be ready")
    wait_for(lambda: "drained" in text(browser, "#events") and decode[0] in text(browser, "#events"),
             what="the drain in the page's events")
