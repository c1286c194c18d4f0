"""The project's logger: one format, rank-aware."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("torchtitan")


def init_logger() -> None:
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    rank = os.environ.get("RANK", "0")
    handler.setFormatter(
        logging.Formatter(f"[rank{rank}] %(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    )
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
