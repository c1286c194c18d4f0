"""The error that ends a rank: one line for the user, the details in a file.

Under the launcher (`python -m torchtitan.launch`, which `run_train.sh` runs) the
environment names a folder (`TORCHTITAN_ERROR_DIR`).  A failing rank writes its
traceback to `error_rank<R>.log` and a report `error_rank<R>.json` there (rank, attempt
(torchrun's restart count), time, whether it is an input error, the one line) and prints
nothing; a restarted rank first removes its report of the attempt before.  The launcher
waits for torchrun, picks the report that explains the failure (`first_report`) and prints
its line.  Without the launcher (plain torchrun) rank 0 prints an input error as `error: ...`
and anything else propagates as Python's traceback.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path

from torchtitan.errors import UserInputError

ERROR_DIR_ENV = "TORCHTITAN_ERROR_DIR"


def error_dir() -> Path | None:
    folder = os.environ.get(ERROR_DIR_ENV)
    return Path(folder) if folder else None


def describe(exc: BaseException, rank: int, details: Path | None) -> str:
    """The user's line: an input error's own message; anything else names the rank, the
    exception and where its traceback is."""
    if isinstance(exc, UserInputError):
        return str(exc)
    first = (str(exc).strip().splitlines() or [""])[0]
    where = f" (traceback: {details})" if details is not None else ""
    return f"rank {rank} failed: {type(exc).__name__}: {first}{where}"


def write_report(exc: BaseException, rank: int, folder: Path) -> None:
    """Write rank `rank`'s traceback and report into `folder` (the report last, whole)."""
    folder.mkdir(parents=True, exist_ok=True)
    details = folder / f"error_rank{rank}.log"
    details.write_text("".join(traceback.format_exception(exc)))
    report = {
        "rank": rank,
        "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "time": time.time(),
        "user_error": isinstance(exc, UserInputError),
        "line": describe(exc, rank, details),
    }
    tmp = folder / f".error_rank{rank}.json.tmp"
    tmp.write_text(json.dumps(report))
    tmp.rename(folder / f"error_rank{rank}.json")


def read_reports(folder: Path) -> list[dict]:
    reports = []
    for path in sorted(folder.glob("error_rank*.json")):
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # a rank killed while writing: its rename never happened
    return reports


def first_report(folder: Path) -> dict | None:
    """The report that explains the failure: an input error before a bug, then the
    earliest (a rank whose peer died fails after it, with a secondary error)."""
    reports = read_reports(folder)
    if not reports:
        return None
    return min(reports, key=lambda r: (not r["user_error"], r["time"], r["rank"]))


def clear_own_report(folder: Path, rank: int) -> None:
    """A restarted rank removes the report it left in an earlier attempt."""
    for name in (f"error_rank{rank}.json", f"error_rank{rank}.log"):
        (folder / name).unlink(missing_ok=True)


def clear_reports(folder: Path) -> None:
    """Remove a previous run's reports, so they cannot be mistaken for this run's."""
    for pattern in ("error_rank*.json", "error_rank*.log"):
        for path in folder.glob(pattern):
            path.unlink(missing_ok=True)
