"""The project's logger: one format, rank-aware, each repeated warning shown once."""

from __future__ import annotations

import logging
from collections import Counter

logger = logging.getLogger("torchtitan")


class _FirstWarningOnly(logging.Filter):
    """Let a warning through the first time its message template is logged; count the
    repeats (a tiny corpus re-looped every few steps would otherwise flood the log)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[str] = Counter()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING:
            return True
        key = str(record.msg)
        self.seen[key] += 1
        return self.seen[key] == 1


_repeats = _FirstWarningOnly()


def repeated_warnings_summary() -> str:
    """'' or one line naming each warning that was suppressed and how often it occurred."""
    repeated = [(msg, n) for msg, n in _repeats.seen.items() if n > 1]
    if not repeated:
        return ""
    return "warnings repeated: " + "; ".join(f"{msg!r} x{n}" for msg, n in repeated)


def init_logger() -> None:
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    handler.addFilter(_repeats)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
