"""Any benchmark script, on the working tree and on another git revision, side by side:
the two trees take turns round by round (each runs its own copy of the script with its own
code), and a JSON path of each result is compared (medians, and the working tree's median
over the revision's).

    .venv/bin/python benchmarks/ab.py --ref e43d903 --rounds 2 \\
        --metric dtypes.bfloat16.throughput.pdserve.output_tokens_per_s \\
        -- offline_throughput.py --dtypes bfloat16 --repeats 2

Writes benchmarks/results/ab_<script>.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.report import write  # noqa: E402
from benchmarks.trees import importable, worktree  # noqa: E402


def lookup(result: dict, path: str):
    """`result["a"]["b"]` for path "a.b"."""
    for key in path.split("."):
        result = result[key]
    return result


def one_run(tree: Path, shim: Path, script: list[str], out: Path, timeout_s: float) -> dict:
    """Run `tree`'s benchmarks/<script> with that tree's code (a script the tree lacks: the
    working tree's, importing the tree's code); its JSON result."""
    path, _ = importable(tree, shim)
    env = {**os.environ, "PYTHONPATH": path}
    source = tree / "benchmarks" / script[0]
    source = source if source.exists() else ROOT / "benchmarks" / script[0]
    subprocess.run([sys.executable, str(source), *script[1:], "--out", str(out)],
                   cwd=tree, env=env, check=True, timeout=timeout_s, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", required=True, help="the git revision to compare the working tree with")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--metric", action="append", required=True, help="JSON path of a figure (repeatable)")
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT.py [ARGS...] (under benchmarks/)")
    args = parser.parse_args()
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        parser.error("name the benchmark script after --")
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        trees = {"working tree": ROOT, args.ref: stack.enter_context(worktree(args.ref, Path(tmp) / "ref"))}
        runs: dict[str, list[dict]] = {name: [] for name in trees}
        for r in range(args.rounds):
            for i, (name, tree) in enumerate(trees.items()):
                result = one_run(tree, Path(tmp) / f"shim-{i}", script, Path(tmp) / f"{i}-{r}.json", args.timeout_s)
                runs[name].append({m: lookup(result, m) for m in args.metric})
    medians = {name: {m: statistics.median(run[m] for run in rs) for m in args.metric} for name, rs in runs.items()}
    result = {"script": script, "ref": args.ref, "rounds": args.rounds, "runs": runs, "medians": medians,
              "working_over_ref": {m: medians["working tree"][m] / medians[args.ref][m] for m in args.metric
                                   if medians[args.ref][m]}}
    write(result, args.out or ROOT / "benchmarks" / "results" / f"ab_{Path(script[0]).stem}.json")


if __name__ == "__main__":
    main()
