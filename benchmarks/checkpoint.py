"""Checkpoints that do not stall training: how long a save holds the training loop,
synchronous against asynchronous, and how long a resume takes to load.

    .venv/bin/python benchmarks/checkpoint.py [--steps 8] [--interval 2] [--rounds 2]

Each configuration is a real 2-rank CPU job (gloo, seq 64, local batch 2) of the debug
Llama 3 (`debugmodel`: dim 256, 6 layers) or the larger `debugmodel_large` (dim 512, 8
layers; both with the test tokenizer's small vocabulary), saving every `--interval` steps
(model + AdamW state: three fp32 copies of the parameters, plus the rest).  The trainer
reports, at the end of a job, the time its loop spent inside `save()` ("checkpointing held
training for X s in N saves"): for a synchronous save that is the whole write plus
checksums; for an asynchronous one, staging the state in memory plus any wait for the save
before it.  Each save also logs the time from its start to its commit ("saved checkpoint
... in X s (checksums Y s)"); for an asynchronous save that time passes in the background.
Then a second job resumes from the newest checkpoint and its load time (verification
included) is read from its log.
Configurations are interleaved over rounds; figures are medians.  Writes the table into
benchmarks/checkpoint.md (between the markers) and prints it.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from pathlib import Path

from torchtitan.tools.loss_compare import run_training

MD = Path(__file__).with_suffix(".md")
HELD = re.compile(r"checkpointing held training for ([\d.]+) s in (\d+) saves")
SAVED = re.compile(r"saved checkpoint \S+ in ([\d.]+) s \(checksums ([\d.]+) s\)")
LOADED = re.compile(r"loaded checkpoint step-\d+ from \S+ in ([\d.]+) s")
COMMON = ["--training.seq_len", "64", "--training.local_batch_size", "2", "--training.seed", "1"]


def _one(output: str, pattern: re.Pattern, what: str) -> re.Match:
    found = pattern.search(output)
    if found is None:
        sys.exit(f"error: no '{what}' line in the job's output:\n{output[-3000:]}")
    return found


def _folder_gib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**30


def measure(flavor: str, mode: str, steps: int, interval: int, folder: Path) -> dict:
    args = [
        *COMMON,
        "--model.flavor",
        flavor,
        "--checkpoint.enable",
        "--checkpoint.interval",
        str(interval),
        "--checkpoint.keep_latest_k",
        "1",
        "--checkpoint.async_mode",
        mode,
    ]
    run = run_training(2, [*args, "--training.steps", str(steps)], folder).check()
    held = _one(run.output, HELD, "checkpointing held training")
    saved = [float(m.group(1)) for m in SAVED.finditer(run.output)]
    hashing = [float(m.group(2)) for m in SAVED.finditer(run.output)]
    size = _folder_gib(folder / "checkpoint" / f"step-{steps}")
    resumed = run_training(2, [*args, "--training.steps", str(steps + 1)], folder).check()
    load = float(_one(resumed.output, LOADED, "loaded checkpoint").group(1))
    return {
        "held": float(held.group(1)) / int(held.group(2)),
        "commit": statistics.median(saved),
        "hashing": statistics.median(hashing),
        "size": size,
        "load": load,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--interval", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args(argv)
    configs = [(f, m) for f in ("debugmodel", "debugmodel_large") for m in ("disabled", "async")]
    results: dict[tuple[str, str], list[dict]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        for r in range(a.rounds):
            for i, (flavor, mode) in enumerate(configs):
                folder = Path(tmp) / f"{i}-{r}"
                results[(flavor, mode)].append(measure(flavor, mode, a.steps, a.interval, folder))
                print(f"round {r + 1}: {flavor} {mode}: {results[(flavor, mode)][-1]}", flush=True)
    lines = [
        "| model | save | checkpoint GiB | training held per save, s | start to commit, s "
        "(checksums) | resume load, s |",
        "|---|---|---|---|---|---|",
    ]
    for flavor, mode in configs:
        rows = results[(flavor, mode)]

        def med(key: str, rows=rows) -> float:
            return statistics.median(row[key] for row in rows)

        label = "synchronous" if mode == "disabled" else "asynchronous"
        lines.append(
            f"| {flavor} | {label} | {med('size'):.2f} | {med('held'):.2f} | "
            f"{med('commit'):.2f} ({med('hashing'):.2f}) | {med('load'):.2f} |"
        )
    table = "\n".join(lines)
    text = MD.read_text()
    start, end = "<!-- table -->", "<!-- /table -->"
    MD.write_text(
        text[: text.index(start) + len(start)] + "\n" + table + "\n" + text[text.index(end) :]
    )
    print(table)


if __name__ == "__main__":
    main()
