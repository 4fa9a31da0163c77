"""`python -m prefill_worker --help`: run a prefill worker's gRPC server."""

import sys

from prefill_worker.service import PrefillService
from worker_base.server import run_worker

if __name__ == "__main__":
    sys.exit(run_worker("prefill", None, PrefillService))
