"""Compare the loss curves of a baseline and a test configuration.

Each side is either RUN here (`--X-options "..." --X-ngpu N`, always with the same seed,
`--training.deterministic`, TensorBoard on and log_freq 1, in a fresh dump folder under
`--output-folder`) or READ from an earlier run (`--X-tb DIR` or `--X-log FILE`), where X is
`baseline` or `test`. `--import-result GOLDEN` replaces the baseline by a golden file.
An options string that is a single option without spaces needs the `=` form:
`--test-options=--training.deterministic`.

Usage::

    python scripts/loss_compare.py --baseline-ngpu 1 \\
        --test-options "--parallelism.tensor_parallel_degree 4" --test-ngpu 4 --rtol 1e-4
    python scripts/loss_compare.py --baseline-options "--training.steps 10" \\
        --export-result golden.txt
    python scripts/loss_compare.py --import-result golden.txt --test-tb outputs/tb --rtol 0

Prints step | baseline | test | rel diff. Exit status: 0 ok, 1 a step differs by more than
`--rtol`, 2 bad input or a failed run.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan.tools import loss_compare as lc  # noqa: E402


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage too)
        raise lc.LossCompareError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        description=__doc__.replace("::", ":"), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for side in ("baseline", "test"):
        g = p.add_argument_group(side)
        g.add_argument(
            f"--{side}-options",
            metavar="OPTS",
            help="trainer options to run with, one quoted string",
        )
        g.add_argument(
            f"--{side}-ngpu", type=int, metavar="N", help="ranks for the run (default 1)"
        )
        g.add_argument(
            f"--{side}-tb", metavar="DIR", help="read losses from this TensorBoard folder"
        )
        g.add_argument(f"--{side}-log", metavar="FILE", help="read losses from this console log")
    p.add_argument("--import-result", metavar="FILE", help="golden file to use as the baseline")
    p.add_argument(
        "--export-result", metavar="FILE", help="write the baseline losses as a golden file"
    )
    p.add_argument(
        "--rtol",
        type=float,
        help="fail (exit 1) if any |test-baseline| > rtol·|baseline|; 0 = exact",
    )
    p.add_argument("--plot", metavar="FILE.png", help="save both curves to this image")
    p.add_argument(
        "--config-file", default=str(lc.DEBUG_TOML), help="TOML for runs (default: the debug model)"
    )
    p.add_argument(
        "--output-folder",
        default="outputs/loss_compare",
        help="parent of the runs' fresh dump folders",
    )
    p.add_argument("--seed", type=int, default=42, help="seed for both runs (default 42)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds allowed per run")
    return p


def side_source(args: argparse.Namespace, side: str) -> str | None:
    """'run', 'tb', 'log' or None, after checking that at most one source is given."""
    opts = getattr(args, f"{side}_options")
    ngpu = getattr(args, f"{side}_ngpu")
    given = [
        name
        for name, on in (
            ("run", opts is not None or ngpu is not None),
            ("tb", getattr(args, f"{side}_tb")),
            ("log", getattr(args, f"{side}_log")),
        )
        if on
    ]
    if len(given) > 1:
        raise lc.LossCompareError(
            f"--{side}-{given[0] if given[0] != 'run' else 'options/ngpu'} and "
            f"--{side}-{given[1]} both give the {side}; choose one"
        )
    if ngpu is not None and ngpu < 1:
        raise lc.LossCompareError(f"--{side}-ngpu must be >= 1, got {ngpu}")
    return given[0] if given else None


def validate(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """Check everything that can be checked before any (slow) run starts."""
    base, test = side_source(args, "baseline"), side_source(args, "test")
    if args.import_result and base:
        raise lc.LossCompareError(
            "--import-result replaces the baseline; drop the --baseline-* options"
        )
    if args.import_result and args.export_result:
        raise lc.LossCompareError(
            "--import-result and --export-result together would copy a golden file"
        )
    if not base and not args.import_result:
        raise lc.LossCompareError(
            "no baseline: give --baseline-options/--baseline-ngpu, --baseline-tb, --baseline-log "
            "or --import-result"
        )
    if not test and not args.export_result:
        raise lc.LossCompareError(
            "no test: give --test-options/--test-ngpu, --test-tb or --test-log (or --export-result)"
        )
    if args.rtol is not None and not args.rtol >= 0:
        raise lc.LossCompareError(f"--rtol must be >= 0, got {args.rtol}")
    if args.rtol is not None and not test:
        raise lc.LossCompareError("--rtol needs a test side to compare")
    for side, source in (("baseline", base), ("test", test)):
        if source in ("tb", "log"):
            path = Path(getattr(args, f"{side}_{source}"))
            if not (path.is_dir() if source == "tb" else path.is_file()):
                raise lc.LossCompareError(f"--{side}-{source}: {path} does not exist")
        if source == "run":
            try:
                shlex.split(getattr(args, f"{side}_options") or "")
            except ValueError as e:
                raise lc.LossCompareError(f"--{side}-options: {e}") from None
            if not Path(args.config_file).is_file():
                raise lc.LossCompareError(f"--config-file: {args.config_file} does not exist")
    for flag, path in (("--export-result", args.export_result), ("--plot", args.plot)):
        if path and not Path(path).resolve().parent.is_dir():
            raise lc.LossCompareError(f"{flag}: folder of {path} does not exist")
    if args.import_result:
        lc.read_golden(args.import_result)  # fail now on a malformed file
    for side, source in (("baseline", base), ("test", test)):
        if source == "run":  # a bad option fails here, not after the other side's run
            problem = lc.preflight(
                getattr(args, f"{side}_ngpu") or 1, run_options(args, side), args.config_file
            )
            if problem:
                raise lc.LossCompareError(f"--{side}-options: {problem}")
    return base, test


def run_options(args: argparse.Namespace, side: str) -> list[str]:
    """The side's options followed by the ones the tool always adds (so those win)."""
    return [*shlex.split(getattr(args, f"{side}_options") or ""), *lc.deterministic_args(args.seed)]


def run_side(args: argparse.Namespace, side: str) -> dict[int, float]:
    options = run_options(args, side)
    ngpu = getattr(args, f"{side}_ngpu") or 1
    out = Path(args.output_folder)
    out.mkdir(parents=True, exist_ok=True)
    dump = Path(tempfile.mkdtemp(prefix=f"{side}-", dir=out))
    shown = getattr(args, f"{side}_options") or "(config defaults)"
    print(f"[{side}] {ngpu} rank(s): {shown} -> {dump}", flush=True)
    start = time.monotonic()
    run = lc.run_training(ngpu, options, dump, config_file=args.config_file, timeout=args.timeout)
    seconds = time.monotonic() - start
    print(f"[{side}] finished in {seconds:.0f} s (rc {run.returncode})", flush=True)
    if run.returncode != 0:
        sys.stderr.write("\n".join(run.output.splitlines()[-30:]) + "\n")
        raise lc.LossCompareError(
            f"{side} run failed (rc {run.returncode}); full output in {dump / lc.LOG_NAME}"
        )
    return run.losses()


def load_side(args: argparse.Namespace, side: str, source: str) -> dict[int, float]:
    if source == "run":
        return run_side(args, side)
    if source == "tb":
        return lc.read_tb_losses(getattr(args, f"{side}_tb"))
    return lc.read_log_losses(getattr(args, f"{side}_log"))


def export_comments(argv: list[str]) -> list[str]:
    """Header of an exported golden file: how to make it again."""
    from importlib.metadata import version

    return [
        "made by: python scripts/loss_compare.py " + shlex.join(argv),
        f"with: torch {version('torch')}, python {sys.version.split()[0]}, "
        "OMP_NUM_THREADS=1 per rank, seed and --training.deterministic added by the tool",
        "format: STEP LOSS per line (loss_metrics/global_avg_loss); '#' lines are ignored",
    ]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    base_src, test_src = validate(args)
    baseline = (
        lc.read_golden(args.import_result)
        if args.import_result
        else load_side(args, "baseline", base_src)
    )
    test = load_side(args, "test", test_src) if test_src else None
    if args.export_result:
        lc.write_golden(args.export_result, baseline, export_comments(argv))
        print(f"wrote {len(baseline)} baseline losses to {args.export_result}")
    print(lc.format_table(baseline, test))
    if args.plot:
        curves = {"baseline": baseline, **({"test": test} if test is not None else {})}
        lc.plot_losses(args.plot, curves)
        print(f"plot: {args.plot}")
    if args.rtol is not None:
        bad = lc.compare(baseline, test, args.rtol)
        if bad:
            print(
                f"FAIL: {len(bad)} step(s) beyond rtol {args.rtol:g}; first "
                f"{bad[0].describe(args.rtol)}"
            )
            return 1
        print(f"OK: all {len(baseline)} steps within rtol {args.rtol:g}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except lc.LossCompareError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
