"""One log format for every pdserve process: one line per event, naming the process role."""

from __future__ import annotations

import logging
import os
import sys


def setup_logging(role: str) -> None:
    """Log to stderr at `PDSERVE_LOG_LEVEL` (default INFO) as `time LEVEL role logger: message`."""
    logging.basicConfig(
        level=os.environ.get("PDSERVE_LOG_LEVEL", "INFO"), stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s {role} %(name)s: %(message)s",
    )
