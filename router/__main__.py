"""`python -m router --decode HOST:PORT --prefill HOST:PORT`: the router over bare workers."""

import sys

from router.server import main

if __name__ == "__main__":
    sys.exit(main())
