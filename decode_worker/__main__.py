"""`python -m pdserve.decode_worker --help`: run a decode worker's gRPC server."""

import sys

from pdserve.decode_worker.service import DecodeService
from pdserve.worker_base.server import run_worker

if __name__ == "__main__":
    sys.exit(run_worker("decode", None, DecodeService))
