"""Bad input before any rank starts: one `error:` line naming the culprit, exit code 2."""

import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan import preflight

REPO = Path(__file__).resolve().parents[2]
DEBUG_TOML = "torchtitan/models/llama3/train_configs/debug_model.toml"


def _preflight(*args, world_size=4):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchtitan.preflight",
            "--world-size",
            str(world_size),
            "--job.config_file",
            DEBUG_TOML,
            *args,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    return proc


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--training.stepz", "3"],
            "--training.stepz: unknown key 'stepz' in section [training]; did you mean 'steps'?",
        ),
        (["--training.steps", "abc"], "--training.steps: expected an integer, got 'abc'"),
        (
            [
                "--parallelism.tensor_parallel_degree",
                "3",
                "--parallelism.data_parallel_shard_degree",
                "2",
            ],
            "multiply to 6 (replicate 1 × shard 2 × tp 3) but the world size is 4",
        ),
        (
            ["--model.name", "llama9"],
            "unknown model 'llama9'; registered: deepseek_v3, deepseek_v3_auto_parallel, "
            "hf_auto_parallel, llama3, llama3_auto_parallel",
        ),
        (["--model.flavor", "7B"], "unknown flavor '7B' for llama3"),
        (["--model.tokenizer_path", "/nonexistent/tok"], "/nonexistent/tok"),
        (["--training.dataset_path", "/nonexistent/data.jsonl"], "/nonexistent/data.jsonl"),
        (["--training.dataset", "c4"], "c4"),
        (
            ["--training.global_batch_size", "6"],
            "global_batch_size 6 is not a multiple of local_batch_size 2",
        ),
        (["--compile.bucket_all_gathers_fx", "most"], "'most' is not one of none, all, only_fsdp"),
        (["--training.local_batch_size", "0"], "--training.local_batch_size: must be >= 1, got 0"),
        (
            ["--training.local_batch_size", "-2"],
            "--training.local_batch_size: must be >= 1, got -2",
        ),
        (["--training.seq_len", "0"], "--training.seq_len: must be >= 1, got 0"),
        (["--training.steps", "0"], "--training.steps: must be >= 1, got 0"),
        (["--training.steps", "-3"], "--training.steps: must be >= 1, got -3"),
        (["--training.gc_freq", "0"], "--training.gc_freq: must be >= 1, got 0"),
        (
            ["--optimizer.lr", "-1"],
            "--optimizer.lr: must be a finite number in [0.0, inf), got -1.0",
        ),
        (
            ["--optimizer.lr", "nan"],
            "--optimizer.lr: must be a finite number in [0.0, inf), got nan",
        ),
        (["--checkpoint.interval", "0"], "--checkpoint.interval: must be >= 1, got 0"),
        (["--metrics.log_freq", "0"], "--metrics.log_freq: must be >= 1, got 0"),
        (
            ["--lr_scheduler.decay_ratio", "2"],
            "--lr_scheduler.decay_ratio: must be a finite number in [0.0, 1.0], got 2.0",
        ),
        (
            ["--training.steps", "3", "--training.steps", "4"],
            "--training.steps: training.steps is set twice on the command line",
        ),
        (
            ["--experimental.custom_import", "no_such_module"],
            "--experimental.custom_import: cannot import 'no_such_module' (ModuleNotFoundError",
        ),
    ],
)
def test_bad_input_is_one_clear_line(args, message, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as exit_info:
        preflight.main(["--world-size", "4", "--job.config_file", DEBUG_TOML, *args])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert message in lines[0]


def test_a_warm_up_longer_than_the_run_is_clamped_with_a_warning():
    smoke = _preflight("--training.steps", "1")  # the debug config warms up for 2 steps
    assert smoke.returncode == 0, smoke.stderr
    assert (
        "--lr_scheduler.warmup_steps 2 is longer than the run (--training.steps 1): warming "
        "up over the whole run instead, so the lr never reaches --optimizer.lr"
    ) in smoke.stderr


def test_subprocess_error_has_no_traceback_and_good_config_passes():
    bad = _preflight("--parallelism.tensor_parallel_degree", "3")
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: ") and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    good = _preflight("--parallelism.tensor_parallel_degree", "2")
    assert good.returncode == 0, good.stderr


def _one_error_line(capsys, *args, world_size=4) -> str:
    with pytest.raises(SystemExit) as exit_info:
        preflight.main(["--world-size", str(world_size), "--job.config_file", DEBUG_TOML, *args])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_tp_degree_must_divide_the_manual_plan_but_not_the_planner(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    line = _one_error_line(capsys, "--parallelism.tensor_parallel_degree", "3", world_size=3)
    assert line == (
        "error: --parallelism.tensor_parallel_degree 3 does not divide n_heads 16, n_kv_heads 16, "
        "dim 256, vocab_size 2000, training.seq_len 256 of llama3 debugmodel; use one that "
        "divides them all and the world size 3: 1"
    )
    # the planner places uneven shards: the same mesh passes for llama3_auto_parallel
    preflight.check(
        _config(
            "--model.name", "llama3_auto_parallel", "--parallelism.tensor_parallel_degree", "3"
        ),
        3,
    )


def _config(*args):
    from torchtitan.config import main_parse

    return main_parse(["--job.config_file", DEBUG_TOML, *args])


def test_output_folders_must_be_writable_and_nothing_is_written(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    line = _one_error_line(capsys, "--job.dump_folder", str(blocker / "out"))
    assert line == (
        f"error: --job.dump_folder: {blocker} is a file, so the folder "
        f"{blocker / 'out'} cannot be created; remove the file or choose another folder"
    )
    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / "tb").write_text("not a folder")
    line = _one_error_line(capsys, "--job.dump_folder", str(dump), "--metrics.enable_tensorboard")
    assert line.startswith(f"error: --metrics.save_tb_folder: {dump / 'tb'} is a file")
    line = _one_error_line(capsys, "--job.dump_folder", "/proc/titan_outputs")
    assert line.startswith("error: --job.dump_folder: cannot write into /proc (")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a_file", "dump", "tb"]


def test_data_and_tokenizer_files_are_parsed_before_any_rank(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    data = tmp_path / "corpus.jsonl"
    data.write_text('{"text": "fine"}\n{"text": 12345}\n')
    line = _one_error_line(capsys, "--training.dataset_path", str(data))
    assert line.startswith(f'error: {data}:2: "text" must be a string, got int')
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_bytes(b"\x00garbage\xff")
    line = _one_error_line(capsys, "--model.tokenizer_path", str(tokenizer))
    assert line.startswith(
        f"error: {tokenizer / 'tokenizer.json'} is not a Hugging Face tokenizer.json"
    )


def test_a_good_config_says_what_was_checked(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    summary = preflight.check(_config(), 4)
    assert summary == (
        "preflight: mesh 1x4x1 (replicate x shard x tp), data "
        "tests/assets/titan_corpus: checked 1 file, 432 documents (all)"
    )
