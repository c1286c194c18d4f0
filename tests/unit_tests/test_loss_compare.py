"""Tests for torchtitan.tools.loss_compare and scripts/loss_compare.py (no training runs)."""

import math
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan.tools import loss_compare as lc

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = ROOT / "scripts/loss_compare.py"
CURVE = {1: 8.13780403137207, 2: 8.19434928894043, 3: 8.041428565979004}


def cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def write_log(path, losses, colour=True):
    red, green, reset = ("\x1b[31m", "\x1b[32m", "\x1b[0m") if colour else ("", "", "")
    lines = ["[rank0]:[titan] 00:00:00 - INFO - building model"]
    lines += [
        f"[rank0]:[titan] 00:00:01 - INFO - {red}step: {s:2}  {green}loss: {v:7.4f}  "
        f"memory:  0.01GiB(0.02%)  tps: 1,234{reset}"
        for s, v in losses.items()
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


# --- log parsing ---------------------------------------------------------------------


def test_parse_log_strips_colour_and_prefixes(tmp_path):
    losses = lc.read_log_losses(write_log(tmp_path / "a.log", CURVE))
    assert losses == {s: round(v, 4) for s, v in CURVE.items()}


def test_parse_log_last_value_wins_and_skips_noise():
    text = "step:  1  loss:  9.0000\nnoise step: x\nstep:  2  loss:  nan\nstep:  1  loss:  8.5000\n"
    losses = lc.parse_log(text)
    assert list(losses) == [1, 2] and losses[1] == 8.5 and math.isnan(losses[2])


def test_read_log_without_steps_is_an_error(tmp_path):
    (tmp_path / "empty.log").write_text("nothing here\n")
    with pytest.raises(lc.LossCompareError, match="no 'step: N"):
        lc.read_log_losses(tmp_path / "empty.log")
    with pytest.raises(lc.LossCompareError, match="cannot read"):
        lc.read_log_losses(tmp_path / "missing.log")


# --- golden files ----------------------------------------------------------------------


def test_golden_round_trip_is_exact(tmp_path):
    path = tmp_path / "g.txt"
    lc.write_golden(path, {3: 0.1 + 0.2, 1: 1 / 3}, ["made by: hand"])
    text = path.read_text()
    assert text.startswith("# made by: hand\n1 0.3333333333333333\n")
    assert lc.read_golden(path) == {1: 1 / 3, 3: 0.1 + 0.2}


@pytest.mark.parametrize(
    "body, message",
    [
        ("1 2.0\n2\n", r":2: expected 'STEP LOSS'"),
        ("1 2.0\nx 3.0\n", r":2: expected 'STEP LOSS'"),
        ("1 2.0\n1 3.0\n", "step 1 appears twice"),
        ("# only a comment\n\n", "no 'STEP LOSS' lines"),
    ],
)
def test_golden_errors(tmp_path, body, message):
    (tmp_path / "g.txt").write_text(body)
    with pytest.raises(lc.LossCompareError, match=message):
        lc.read_golden(tmp_path / "g.txt")


def test_repo_golden_file_is_documented_and_complete():
    path = ROOT / "tests/assets/losses/llama3_cpu_1rank.txt"
    assert path.read_text().startswith("# made by: python scripts/loss_compare.py ")
    assert list(lc.read_golden(path)) == list(range(1, 11))


# --- comparison ------------------------------------------------------------------------


def test_compare_exact_and_relative():
    test = {1: CURVE[1], 2: CURVE[2] * (1 + 5e-6), 3: CURVE[3]}
    assert lc.compare(CURVE, dict(CURVE), rtol=0) == []
    assert [m.step for m in lc.compare(CURVE, test, rtol=0)] == [2]
    assert lc.compare(CURVE, test, rtol=1e-5) == []
    assert [m.step for m in lc.compare(CURVE, test, rtol=1e-6)] == [2]


def test_compare_missing_steps_and_nan():
    bad = lc.compare({1: 1.0, 2: 2.0}, {2: math.nan, 3: 3.0}, rtol=1.0)
    assert [(m.step, m.baseline, m.test is None) for m in bad] == [
        (1, 1.0, True),
        (2, 2.0, False),
        (3, None, False),
    ]
    assert "missing in test" in bad[0].describe(1.0)
    assert "missing in baseline" in bad[2].describe(1.0)


def test_compare_rejects_negative_rtol():
    with pytest.raises(lc.LossCompareError, match="rtol"):
        lc.compare(CURVE, CURVE, rtol=-1)


def test_assert_losses_close_names_first_offending_step():
    lc.assert_losses_close(dict(CURVE), CURVE, rtol=0)
    actual = {1: CURVE[1], 2: CURVE[2] + 0.01, 3: CURVE[3] + 0.01}
    with pytest.raises(
        AssertionError,
        match=r"my run: 2 of 3 steps differ; first step 2: "
        r"test 8\.20434928894043 vs baseline 8\.1943",
    ):
        lc.assert_losses_close(actual, CURVE, rtol=1e-4, what="my run")


def test_format_table():
    table = lc.format_table({1: 2.0, 2: 4.0}, {1: 2.0, 2: 5.0}).splitlines()
    assert table[0].split() == ["step", "baseline", "test", "rel", "diff"]
    assert table[2].split() == ["2", "4.000000", "5.000000", "2.500e-01"]
    assert lc.format_table({1: 2.0}).splitlines()[1].split() == ["1", "2.000000"]


# --- TensorBoard and plot ---------------------------------------------------------------


def test_read_tb_losses(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "tb"))
    for step, loss in CURVE.items():
        writer.add_scalar(lc.LOSS_TAG, loss, step)
    writer.close()
    losses = lc.read_tb_losses(tmp_path / "tb")
    assert list(losses) == [1, 2, 3]
    assert all(abs(losses[s] - CURVE[s]) <= 1e-6 * CURVE[s] for s in CURVE)  # stored as float32
    with pytest.raises(lc.LossCompareError, match="no 'other' scalars"):
        lc.read_tb_losses(tmp_path / "tb", tag="other")
    with pytest.raises(lc.LossCompareError, match="no such TensorBoard folder"):
        lc.read_tb_losses(tmp_path / "nope")


def test_plot_writes_png(tmp_path):
    lc.plot_losses(tmp_path / "p.png", {"baseline": CURVE, "test": {1: 8.0, 3: 7.9}})
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(lc.LossCompareError, match="cannot write plot"):
        lc.plot_losses(tmp_path / "p.notaformat", {"baseline": CURVE})


# --- CLI -------------------------------------------------------------------------------


def test_cli_golden_vs_log_pass_and_fail(tmp_path):
    golden = tmp_path / "g.txt"
    lc.write_golden(golden, {s: round(v, 4) for s, v in CURVE.items()})
    log = write_log(tmp_path / "t.log", CURVE)
    ok = cli(
        "--import-result", golden, "--test-log", log, "--rtol", 0, "--plot", tmp_path / "c.png"
    )
    assert ok.returncode == 0, ok.stderr
    assert "OK: all 3 steps within rtol 0" in ok.stdout and (tmp_path / "c.png").exists()
    assert ok.stdout.splitlines()[0].split() == ["step", "baseline", "test", "rel", "diff"]

    write_log(log, {**CURVE, 2: 8.3, 3: 8.3})
    bad = cli("--import-result", golden, "--test-log", log, "--rtol", 1e-3)
    assert bad.returncode == 1
    assert (
        "FAIL: 2 step(s) beyond rtol 0.001; first step 2: test 8.3 vs baseline 8.1943" in bad.stdout
    )


def test_cli_export_from_log(tmp_path):
    log = write_log(tmp_path / "b.log", CURVE, colour=False)
    out = tmp_path / "golden.txt"
    res = cli("--baseline-log", log, "--export-result", out)
    assert res.returncode == 0, res.stderr
    text = out.read_text()
    assert text.startswith(f"# made by: python scripts/loss_compare.py --baseline-log {log} ")
    assert lc.read_golden(out) == {s: round(v, 4) for s, v in CURVE.items()}


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "no baseline"),
        (["--baseline-log", "{log}"], "no test"),
        (
            ["--baseline-log", "{log}", "--baseline-tb", "{tmp}", "--test-log", "{log}"],
            "--baseline-tb and --baseline-log both give the baseline",
        ),
        (
            ["--baseline-ngpu", "2", "--baseline-log", "{log}", "--test-log", "{log}"],
            "--baseline-options/ngpu and --baseline-log",
        ),
        (
            ["--import-result", "{log}", "--baseline-log", "{log}", "--test-log", "{log}"],
            "--import-result replaces the baseline",
        ),
        (["--import-result", "{log}", "--test-log", "{log}"], "expected 'STEP LOSS'"),
        (
            ["--baseline-log", "{tmp}/missing.log", "--test-log", "{log}"],
            "missing.log does not exist",
        ),
        (["--baseline-tb", "{tmp}/missing", "--test-log", "{log}"], "does not exist"),
        (["--baseline-log", "{log}", "--test-log", "{log}", "--rtol", "-1"], "--rtol must be >= 0"),
        (
            ["--baseline-log", "{log}", "--export-result", "{tmp}/g.txt", "--rtol", "0"],
            "needs a test",
        ),
        (["--baseline-log", "{log}", "--test-ngpu", "0"], "--test-ngpu must be >= 1"),
        (
            ["--baseline-log", "{log}", "--test-options", "--a 'b"],
            "--test-options: No closing quotation",
        ),
        (
            ["--baseline-log", "{log}", "--test-log", "{log}", "--plot", "{tmp}/no/p.png"],
            "--plot: folder of",
        ),
        (["--baseline-log", "{log}", "--test-log", "{log}", "--rtol", "x"], "invalid float value"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (
            ["--baseline-log", "{log}", "--test-options", "--training.bogus 1", "--test-ngpu", "4"],
            "--test-options: --training.bogus: unknown key 'bogus'",
        ),  # preflight, no ranks started
    ],
)
def test_cli_bad_input_is_one_error_line(tmp_path, args, message):
    log = write_log(tmp_path / "a.log", CURVE)
    res = cli(*(a.format(log=log, tmp=tmp_path) for a in args))
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("error: "), res.stderr
    assert message in res.stderr
    assert res.stdout == ""
