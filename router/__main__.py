"""`python -m pdserve.router --decode HOST:PORT --prefill HOST:PORT`: the router over bare workers."""

import sys

from pdserve.router.server import main

if __name__ == "__main__":
    sys.exit(main())
