"""Whether this machine overlaps a memory stream with arithmetic: one thread reads a 512 MB
array in chunks of 6 KB (a block of KV, 16 tokens of SmolLM2's three kv heads in bf16) and
runs a chain of dependent FMAs between chunks, as an attention kernel computes between the
blocks it reads. Side by side, interleaved, median of `--repeats`:

- `memory`: the reads alone (no FMAs);
- `compute`: the FMAs alone (the same chunks read from a 48 KB array that stays in L1);
- `both`: reads and FMAs, the hardware prefetchers left to find the stream;
- `both+prefetch/N`: the same with software prefetches (into L2) of the chunk N ahead.

Where memory and arithmetic overlap, `both` takes max(memory, compute); where they do not,
memory + compute. The attainable floor of roofline.py assumes the overlap.

    .venv/bin/python benchmarks/overlap.py [--work 400] [--repeats 5]

Writes benchmarks/results/overlap.json. Needs a C compiler (gcc); x86-64 with FMA.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.report import write  # noqa: E402

SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char** argv) {
  const int reads = atoi(argv[1]), work = atoi(argv[2]), ahead = atoi(argv[3]);
  const size_t n = (size_t)512 << 20, chunk = 6144, small = 8 * chunk;
  char* a = aligned_alloc(4096, n);
  for (size_t i = 0; i < n; i++) a[i] = (char)i;
  __m256 acc = _mm256_set1_ps(1.f), m = _mm256_set1_ps(1.0000001f);
  int64_t s = 0;
  const double start = now();
  for (size_t c = 0; c + chunk <= n; c += chunk) {
    const char* p = reads ? a + c : a + c % small;
    if (reads && ahead && c + (ahead + 1) * chunk <= n)
      for (size_t l = 0; l < chunk; l += 64) _mm_prefetch(a + c + ahead * chunk + l, _MM_HINT_T1);
    for (int w = 0; w < work; w++) acc = _mm256_fmadd_ps(acc, m, acc);
    for (size_t l = 0; l < chunk; l += 64) s += p[l];
  }
  const double seconds = now() - start;
  float f[8];
  _mm256_storeu_ps(f, acc);
  printf("%.6f %ld %g\n", seconds, (long)s, f[0]);
  return 0;
}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=int, default=400, help="dependent FMAs between chunks")
    parser.add_argument("--ahead", default="4,16,64", help="software prefetch distances, in chunks")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "overlap.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "overlap"
        (Path(tmp) / "overlap.c").write_text(SOURCE)
        subprocess.run(["gcc", "-O2", "-mavx2", "-mfma", "-o", str(binary), str(Path(tmp) / "overlap.c")], check=True)
        cases = {"memory": (1, 0, 0), "compute": (0, args.work, 0), "both": (1, args.work, 0),
                 **{f"both+prefetch/{d}": (1, args.work, int(d)) for d in args.ahead.split(",")}}
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.repeats):
            for name, (reads, work, ahead) in cases.items():  # interleaved
                out = subprocess.run([str(binary), str(reads), str(work), str(ahead)], check=True,
                                     capture_output=True, text=True).stdout
                times[name].append(float(out.split()[0]))
    ms = {name: 1000 * statistics.median(values) for name, values in times.items()}
    overlapped, serial = max(ms["memory"], ms["compute"]), ms["memory"] + ms["compute"]
    result = {"setup": {"cores": os.cpu_count(), "load_average": os.getloadavg(), "work": args.work,
                        "chunk_bytes": 6144, "array_mb": 512},
              "ms": ms, "if_overlapped_ms": overlapped, "if_serial_ms": serial,
              # 0: both takes max(memory, compute) (full overlap); 1: memory + compute (none)
              "serial_fraction": {name: (ms[name] - overlapped) / (serial - overlapped)
                                  for name in ms if name.startswith("both")}}
    print({n: round(t, 1) for n, t in ms.items()}, "serial fraction",
          {n: round(f, 2) for n, f in result["serial_fraction"].items()}, flush=True)
    write(result, args.out, None)


if __name__ == "__main__":
    main()
