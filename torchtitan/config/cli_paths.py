"""Relative paths on the command line mean the directory the user typed the command in.

`run_train.sh` changes into the repository (the shipped configs name the test assets relative
to it), so a relative `--job.dump_folder out` would otherwise land in the checkout.  The
launcher passes the user's directory here and rewrites the path options given on the command
line before any rank starts; paths in a TOML file keep meaning the repository.

An input that exists only relative to the repository (`--training.dataset_path
tests/assets/...` typed from elsewhere) is left as it is; one that exists relative to the
user's directory, or in neither place (the error then names the user's path), is made
absolute against the user's directory.  An output folder always is.
"""

from __future__ import annotations

import os

# dotted option -> whether it names something to read (else a folder to write)
PATH_OPTIONS = {
    "job.config_file": True,
    "job.dump_folder": False,
    "model.tokenizer_path": True,
    "training.dataset_path": True,
    "checkpoint.initial_load_path": True,
}


def resolve_cli_paths(argv: list[str], user_cwd: str) -> list[str]:
    """`argv` (`--section.key value` / `--section.key=value` options) with the relative
    values of `PATH_OPTIONS` resolved against `user_cwd` (module docstring)."""
    out = list(argv)
    for i, tok in enumerate(out):
        opt, eq, value = tok.partition("=")
        dotted = opt[2:].replace("-", "_") if opt.startswith("--") else ""
        if dotted not in PATH_OPTIONS:
            continue
        if not eq:
            if i + 1 >= len(out) or out[i + 1].startswith("--"):
                continue  # no value: the config parser names the mistake
            value = out[i + 1]
        resolved = _resolve(value, user_cwd, PATH_OPTIONS[dotted])
        if eq:
            out[i] = f"{opt}={resolved}"
        else:
            out[i + 1] = resolved
    return out


def _resolve(value: str, user_cwd: str, is_input: bool) -> str:
    if not value or os.path.isabs(value):
        return value
    theirs = os.path.normpath(os.path.join(user_cwd, value))
    if is_input and not os.path.exists(theirs) and os.path.exists(value):
        return value  # the repository's
    return theirs
