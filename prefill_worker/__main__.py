"""`python -m pdserve.prefill_worker --help`: run a prefill worker's gRPC server."""

import sys

from pdserve.prefill_worker.service import PrefillService
from pdserve.worker_base.server import run_worker

if __name__ == "__main__":
    sys.exit(run_worker("prefill", None, PrefillService))
