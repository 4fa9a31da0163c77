"""`pdserve status --watch`: the table is fetched and drawn again every interval on a cleared
screen, a failed fetch is shown and retried, and Ctrl-C ends it with exit code 0."""

from __future__ import annotations

import pytest

from pdserve.cluster.cli import main
from pdserve.cluster.cli_service import CLEAR_SCREEN, watch_status


def status(running: int) -> dict:
    worker = {"worker_id": "decode-1", "address": "127.0.0.1:1", "state": "ready", "dtype": "float32",
              "num_threads": 2, "stats": {"num_running": running, "num_waiting": 0, "num_total_blocks": 10,
                                          "num_free_blocks": 5}}
    return {"router": "http://r", "model": "tiny", "routing": None, "autoscaler": {"enabled": False},
            "pools": {"prefill": {"target": 0, "workers": []}, "decode": {"target": 1, "workers": [worker]}},
            "events": [{"time": 0, "role": "decode", "event": "ready", "worker_id": "decode-1", "detail": ""}]}


class FakeController:
    """Answers status() with one more running request each time; fails once on the third."""

    def __init__(self) -> None:
        self.calls = 0

    def status(self) -> dict:
        self.calls += 1
        if self.calls == 3:
            raise ConnectionError("controller restarting")
        return status(running=self.calls)


def test_watch_redraws_every_interval_until_ctrl_c(capsys):
    controller, slept = FakeController(), []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == 4:
            raise KeyboardInterrupt

    assert watch_status(controller.status, 0.5, sleep=sleep) == 0
    screens = capsys.readouterr().out.split(CLEAR_SCREEN)[1:]
    assert controller.calls == 4 and slept == [0.5] * 4 and len(screens) == 4
    running = [next(line for line in s.splitlines() if "decode-1" in line and "running" in line) for s in screens
               if "unavailable" not in s]
    assert [line.split("running")[1].split()[0] for line in running] == ["1", "2", "4"]
    assert "status unavailable: controller restarting" in screens[2]
    assert all("every 0.5s" in s for s in screens)


def test_status_help_shows_watch_and_interval(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["status", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--watch" in out and "--interval SECONDS" in out
