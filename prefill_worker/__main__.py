"""`python -m prefill_worker --help`: run a prefill worker's gRPC server."""

import sys

from engine.worker_server import run_worker
from prefill_worker.service import PrefillService

if __name__ == "__main__":
    sys.exit(run_worker("prefill", None, PrefillService))
