"""Simulated workers start a few at a time per machine (cluster.actors._start_slot: file
locks, as many as the cores): never more at once than the slots, a slot comes back when its
start fails or its process dies, and without a folder (real models) nothing waits."""

import asyncio
import subprocess
import sys
import time

import pytest

from pdserve.cluster.actors import _start_slot


def peak_at_once(folder, starts: int, slots: int | None = 2) -> int:
    running = peak = 0

    async def start() -> None:
        nonlocal running, peak
        async with _start_slot(folder, slots):
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(0.03)
            running -= 1

    async def main() -> None:
        await asyncio.gather(*(start() for _ in range(starts)))

    asyncio.run(main())
    return peak


def test_no_more_start_at_once_than_the_slots(tmp_path):
    assert peak_at_once(tmp_path / "slots", 7, slots=2) == 2
    assert peak_at_once(tmp_path / "slots", 3, slots=1) == 1


def test_without_a_folder_nothing_waits():
    assert peak_at_once(None, 5) == 5


def test_a_failed_start_gives_its_slot_back(tmp_path):
    async def main() -> None:
        with pytest.raises(RuntimeError):
            async with _start_slot(tmp_path, 1):
                raise RuntimeError("engine failed")
        async with asyncio.timeout(2):
            async with _start_slot(tmp_path, 1):
                pass

    asyncio.run(main())


def test_a_slot_is_shared_with_other_processes_until_they_end(tmp_path):
    tmp_path.joinpath("0.lock").touch()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX); "
        "print('held', flush=True); time.sleep(0.6)"), str(tmp_path / "0.lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()

        async def main() -> None:
            async with _start_slot(tmp_path, 1):
                pass

        asyncio.run(main())
        assert time.monotonic() - start > 0.3  # waited for the other process to end
    finally:
        holder.kill()
        holder.wait()
