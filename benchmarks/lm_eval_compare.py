"""lm-eval end to end: its `local-completions` model against the router vs its own `hf` model.

Both score the same small multiple-choice task (`pdserve_mc`: tests/data/lm_eval, a local
JSONL, no hub download) on the same checkpoint (the one `pdserve up` serves, in float32 on
both sides). lm-eval's `local-completions` sends one request per (context, choice) to
/v1/completions: `prompt` as token ids ([[ids]]), `echo: true`, `logprobs: 1`,
`max_tokens: 1`, `temperature: 0`, and sums `choices[0].logprobs.token_logprobs` over the
choice's tokens. The comparison: the same accuracy, and every per-item, per-choice
log-likelihood within 1e-3 of HF's (also reported: the largest difference, whether each
item's argmax choice agrees, whether the is-greedy flags agree). The figures go to
benchmarks/results/lm_eval_compare.json.

lm-eval runs in its own virtualenv that borrows torch and transformers from .venv through a
.pth file, so no second torch is downloaded (nothing is installed into .venv):

    python3 -m venv /tmp/lmeval
    echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/lmeval/lib/python3.11/site-packages/pdserve_venv.pth
    /tmp/lmeval/bin/pip install "lm-eval[api]==0.4.13"
    .venv/bin/python benchmarks/lm_eval_compare.py --lm-eval /tmp/lmeval/bin/lm_eval

Without `--url` the script starts `pdserve up` on a free port with both pools in float32
(HF's dtype here) and stops it afterwards (`pdserve down`, which also stops the local Ray
that `up` started). With `--url` the service there should run float32 too.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TASK = "pdserve_mc"
TASK_DIR = ROOT / "tests/data/lm_eval"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_service(pdserve: str, port: int) -> str:
    """`pdserve up --detach` on `port`, both pools in float32; the router's base URL."""
    cmd = [pdserve, "up", "--detach", "--port", str(port),
           "--set", 'prefill.engine.dtype="float32"', "--set", 'decode.engine.dtype="float32"']
    subprocess.run(cmd, check=True, cwd=tempfile.gettempdir())
    return f"http://127.0.0.1:{port}"


def stop_service(pdserve: str) -> None:
    subprocess.run([pdserve, "down"], cwd=tempfile.gettempdir())


def run_lm_eval(exe: str, model: str, model_args: dict, out_dir: Path, limit: int | None) -> dict:
    """One lm-eval run of the task with --log_samples; its exit code, time, accuracy and samples."""
    cmd = [exe, "run", "--model", model, "--model_args", ",".join(f"{k}={v}" for k, v in model_args.items()),
           "--tasks", TASK, "--include_path", str(TASK_DIR), "--batch_size", "1",
           "--log_samples", "--output_path", str(out_dir)]
    if model == "hf":
        cmd += ["--device", "cpu"]
    if limit:
        cmd += ["--limit", str(limit)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    if os.environ.get("PDSERVE_API_KEY"):  # lm-eval sends `Authorization: Bearer $OPENAI_API_KEY`
        env["OPENAI_API_KEY"] = os.environ["PDSERVE_API_KEY"].split(",")[0].strip()
    started = time.monotonic()
    # from a directory other than the repository, as the other client benchmarks run
    proc = subprocess.run(cmd, cwd=out_dir.parent, capture_output=True, text=True, timeout=3600, env=env)
    result = {"model_type": model, "model_args": model_args, "exit_code": proc.returncode,
              "wall_s": round(time.monotonic() - started, 2)}
    results = sorted(out_dir.rglob("results_*.json"))
    samples = sorted(out_dir.rglob(f"samples_{TASK}_*.jsonl"))
    if proc.returncode != 0 or not results or not samples:
        output = proc.stdout + proc.stderr
        # the server's answer, as lm-eval logs it before retrying
        result["api_errors"] = [line[-600:] for line in output.splitlines() if "API request failed" in line][:3]
        result["error_tail"] = output[-3000:]
        return result
    task_results = json.loads(results[-1].read_text())["results"][TASK]
    result["acc"] = task_results["acc,none"]
    result["samples"] = load_samples(samples[-1])
    result["items"] = len(result["samples"])
    return result


def load_samples(path: Path) -> dict[int, dict]:
    """doc_id -> the scored (context, continuation) pairs, each choice's log-likelihood and
    is-greedy flag (lm-eval writes them as strings), the gold index and the item's acc."""
    out = {}
    for line in path.read_text().splitlines():
        s = json.loads(line)
        resps = s["filtered_resps"]
        out[s["doc_id"]] = {
            "pairs": [[a["arg_0"], a["arg_1"]] for _, a in sorted(s["arguments"].items(),
                                                                   key=lambda kv: int(kv[0].rsplit("_", 1)[1]))],
            "loglikelihoods": [float(r[0]) for r in resps],
            "greedy": [str(r[1]) == "True" for r in resps],
            "target": int(s["target"]), "acc": float(s["acc"])}
    return out


def argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


def compare(hf: dict, api: dict, tol: float) -> dict:
    """Per item and choice: |loglikelihood difference|, within `tol`, argmax and greedy agreement."""
    if hf.keys() != api.keys():
        return {"error": f"different items scored: hf {len(hf)}, local-completions {len(api)}"}
    diffs, argmax_agree, greedy_agree, pairs_differ, per_item = [], 0, 0, 0, []
    for doc_id in sorted(hf):
        a, b = hf[doc_id], api[doc_id]
        if a["pairs"] != b["pairs"]:
            pairs_differ += 1
            continue
        item = [abs(x - y) for x, y in zip(a["loglikelihoods"], b["loglikelihoods"], strict=True)]
        diffs += item
        argmax_agree += argmax(a["loglikelihoods"]) == argmax(b["loglikelihoods"])
        greedy_agree += sum(x == y for x, y in zip(a["greedy"], b["greedy"], strict=True))
        per_item.append({"doc_id": doc_id, "context": a["pairs"][0][0], "max_abs_diff": max(item),
                         "hf": a["loglikelihoods"], "local_completions": b["loglikelihoods"]})
    per_item.sort(key=lambda r: -r["max_abs_diff"])
    return {"items": len(hf), "items_with_different_requests": pairs_differ, "choices": len(diffs),
            "max_abs_diff": max(diffs, default=None),
            "mean_abs_diff": sum(diffs) / len(diffs) if diffs else None,
            "within_tol": sum(d <= tol for d in diffs), "argmax_agree": argmax_agree,
            "greedy_flags_agree": greedy_agree, "worst_items": per_item[:5]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lm-eval", default="/tmp/lmeval/bin/lm_eval", help="the lm_eval executable (its own venv)")
    parser.add_argument("--url", help="a running pdserve router (default: start `pdserve up` and stop it after)")
    parser.add_argument("--tol", type=float, default=1e-3, help="largest allowed log-likelihood difference")
    parser.add_argument("--limit", type=int, default=None, help="score only the first N items")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/lm_eval_compare.json"))
    args = parser.parse_args()

    from pdserve.engine.config import DEFAULT_MODEL
    from pdserve.engine.model_source import resolve_model

    checkpoint = str(resolve_model(DEFAULT_MODEL))
    pdserve = str(Path(sys.executable).with_name("pdserve"))
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        runs["hf"] = run_lm_eval(args.lm_eval, "hf", {"pretrained": checkpoint, "dtype": "float32"},
                                 work / "hf", args.limit)
        print(json.dumps({k: v for k, v in runs["hf"].items() if k not in ("samples", "error_tail")}), flush=True)
        url = args.url
        try:
            if url is None:
                url = start_service(pdserve, free_port())
            api_args = {"model": DEFAULT_MODEL, "base_url": f"{url.rstrip('/')}/v1/completions",
                        "tokenizer": checkpoint, "tokenizer_backend": "huggingface",
                        "tokenized_requests": True, "num_concurrent": 1, "max_retries": 3}
            runs["local-completions"] = run_lm_eval(args.lm_eval, "local-completions", api_args,
                                                    work / "local-completions", args.limit)
        finally:
            if args.url is None:
                stop_service(pdserve)
        print(json.dumps({k: v for k, v in runs["local-completions"].items()
                          if k not in ("samples", "error_tail")}), flush=True)
    for name, run in runs.items():
        if "error_tail" in run:
            print(f"--- {name} failed:\n{run['error_tail']}", file=sys.stderr)

    hf, api = runs["hf"], runs["local-completions"]
    comparison = (compare(hf["samples"], api["samples"], args.tol)
                  if "samples" in hf and "samples" in api else {"error": "a run failed"})
    same_acc = "acc" in hf and "acc" in api and hf["acc"] == api["acc"]
    all_within = (comparison.get("choices") is not None and not comparison.get("items_with_different_requests")
                  and comparison["within_tol"] == comparison["choices"] > 0)
    ok = same_acc and all_within
    report = {"task": TASK, "checkpoint": checkpoint, "dtype": "float32", "tolerance": args.tol,
              "url": args.url or "pdserve up (started by the script)", "pass": ok,
              "same_accuracy": same_acc, "every_loglikelihood_within_tol": all_within,
              "runs": {name: {k: v for k, v in run.items() if k != "samples"} for name, run in runs.items()},
              "comparison": comparison}
    Path(args.out).write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"acc: hf {hf.get('acc')}, local-completions {api.get('acc')} ({'same' if same_acc else 'DIFFERENT'}); "
          f"log-likelihoods within {args.tol}: {comparison.get('within_tol')}/{comparison.get('choices')} "
          f"(max |diff| {comparison.get('max_abs_diff')}); argmax agrees on "
          f"{comparison.get('argmax_agree')}/{comparison.get('items')} items")
    print(f"{'PASS' if ok else 'FAIL'}: same accuracy, every log-likelihood within {args.tol}; wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
