"""Time to first token of long prompts on the offline engine (the embedded SmolLM2-135M,
chunks of `--chunk` tokens): one request of N random tokens, one output token, median of
`--repeats`, per dtype. Run it through ab.py to compare revisions side by side:

    .venv/bin/python benchmarks/ab.py --ref b1d8c17 --rounds 2 --metric ttft_s.bfloat16.8000 \\
        -- long_prompt_ttft.py
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.report import write  # noqa: E402


def main() -> None:
    from pdserve.engine import LLM, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="512,2048,8000")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "long_prompt_ttft.json")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    result: dict = {"setup": {"cores": os.cpu_count(), "load_average": os.getloadavg(), "chunk": args.chunk},
                    "ttft_s": {}, "all_s": {}}
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for dtype in args.dtypes.split(","):
        llm = LLM(dtype=dtype, max_model_len=max(lengths) + 16, max_num_batched_tokens=args.chunk,
                  enable_prefix_caching=False)
        llm.generate([[random.Random(0).randrange(100, 40000) for _ in range(64)]], params)  # warm-up
        for n in lengths:
            times = []
            for r in range(args.repeats):
                prompt = [random.Random(r * 7919 + n).randrange(100, 40000) for _ in range(n)]
                start = time.perf_counter()
                llm.generate([prompt], params)
                times.append(time.perf_counter() - start)
            result["ttft_s"].setdefault(dtype, {})[str(n)] = statistics.median(times)
            result["all_s"].setdefault(dtype, {})[str(n)] = times
            print(dtype, n, round(statistics.median(times), 3), flush=True)
        del llm
    write(result, args.out)


if __name__ == "__main__":
    main()
