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
        [sys.executable, "-m", "torchtitan.preflight", "--world-size", str(world_size),
         "--job.config_file", DEBUG_TOML, *args],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    return proc


@pytest.mark.parametrize("args, message", [
    (["--training.stepz", "3"], "--training.stepz: unknown key 'stepz' in section [training]; did you mean 'steps'?"),
    (["--training.steps", "abc"], "--training.steps: expected an integer, got 'abc'"),
    (["--parallelism.tensor_parallel_degree", "3", "--parallelism.data_parallel_shard_degree", "2"],
     "multiply to 6 (replicate 1 × shard 2 × tp 3) but the world size is 4"),
    (["--model.name", "llama9"], "unknown model 'llama9'; registered: hf_auto_parallel, llama3, llama3_auto_parallel"),
    (["--model.flavor", "7B"], "unknown flavor '7B' for llama3"),
    (["--model.tokenizer_path", "/nonexistent/tok"], "/nonexistent/tok"),
    (["--training.dataset_path", "/nonexistent/data.jsonl"], "/nonexistent/data.jsonl"),
    (["--training.dataset", "c4"], "c4"),
    (["--training.global_batch_size", "6"], "global_batch_size 6 is not a multiple of local_batch_size 2"),
    (["--compile.bucket_all_gathers_fx", "most"], "'most' is not one of none, all, only_fsdp"),
])
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


def test_subprocess_error_has_no_traceback_and_good_config_passes():
    bad = _preflight("--parallelism.tensor_parallel_degree", "3")
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: ") and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    good = _preflight("--parallelism.tensor_parallel_degree", "2")
    assert good.returncode == 0, good.stderr
