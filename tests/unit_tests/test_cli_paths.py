"""Relative paths typed on the command line mean the user's directory (config/cli_paths.py)."""

from __future__ import annotations

import os

from torchtitan.config.cli_paths import resolve_cli_paths


def test_relative_paths_on_the_command_line_mean_the_users_directory(tmp_path, monkeypatch):
    repo, user = tmp_path / "repo", tmp_path / "user"
    (repo / "assets").mkdir(parents=True)
    (repo / "assets" / "data.txt").write_text("the repository's\n")
    (user / "mine").mkdir(parents=True)
    (user / "mine" / "data.txt").write_text("the user's\n")
    (user / "job.toml").write_text("")
    monkeypatch.chdir(repo)  # the launcher runs in the repository
    argv = [
        "--job.config_file",
        "job.toml",  # the user's
        "--job.dump_folder=out",  # an output: always the user's
        "--training.dataset_path",
        "mine/data.txt",  # the user's
        "--model.tokenizer_path",
        "assets/data.txt",  # only in the repository: left alone
        "--checkpoint.initial_load_path",
        "absent",  # in neither: the user's, so an error names their path
        "--training.steps",
        "3",
        "--checkpoint.folder",
        "ckpt",  # relative to the dump folder, not a directory the user is in
    ]
    assert resolve_cli_paths(argv, str(user)) == [
        "--job.config_file",
        str(user / "job.toml"),
        f"--job.dump_folder={user / 'out'}",
        "--training.dataset_path",
        str(user / "mine" / "data.txt"),
        "--model.tokenizer_path",
        "assets/data.txt",
        "--checkpoint.initial_load_path",
        str(user / "absent"),
        "--training.steps",
        "3",
        "--checkpoint.folder",
        "ckpt",
    ]
    absolute = ["--job.dump_folder", os.sep + "elsewhere", "--job.dump-folder"]
    assert resolve_cli_paths(absolute, str(user)) == absolute  # absolute; no value: untouched
