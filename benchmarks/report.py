"""What every benchmark script writes: its result as JSON, a PNG beside it, and the JSON
on stdout; figures are headless matplotlib, one row of panels."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def repo_relative(path: str | Path) -> str:
    """`path` relative to the repository root (e.g. `../shared/workloads/x.jsonl`), so a
    result names its inputs the same way on every machine."""
    return os.path.relpath(Path(path).resolve(), ROOT)


async def sse_events(response):
    """The JSON events of an OpenAI SSE stream (aiohttp response), up to `[DONE]`."""
    async for raw in response.content:
        line = raw.strip()
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            yield json.loads(line[6:])


def write(result: dict, out: Path, plot: Callable[[dict, Path], None] | None = None) -> None:
    """Write `result` to `out` (JSON), `plot(result, out.with_suffix(".png"))`, print it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    if plot is not None:
        plot(result, out.with_suffix(".png"))
    print(json.dumps(result, indent=2))


@contextmanager
def panels(path: Path, count: int = 1, width: float = 5.0, height: float = 4.0):
    """Yield `count` axes side by side; on exit lay them out and save the figure to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, count, figsize=(width * count, height), squeeze=False)
    yield list(axes[0])
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def grouped_bars(ax, groups: dict[str, dict[str, float]], rotation: float = 0, fontsize: float | None = None) -> None:
    """One bar per series in every group, side by side (`groups[group][series]` = height),
    the groups' names under them, and a legend of the series."""
    series = list(next(iter(groups.values())))
    width = 0.8 / len(series)
    for i, name in enumerate(series):
        ax.bar([j + i * width for j in range(len(groups))], [g[name] for g in groups.values()], width=width,
               label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))], list(groups), rotation=rotation,
                  fontsize=fontsize)
    ax.legend()
