"""Check a job's configuration once, before any rank starts.

`python -m torchtitan.preflight --world-size N <train args>` (the launcher runs the same
`check` in-process) parses the config, checks every value range, the mesh degrees
against the world size, the model spec's own mesh requirements, the tokenizer, the data
files (parsed, a sample of a huge corpus), the output folders (writable, no file in the
way) and the checkpoint chosen for loading — what a rank would otherwise trip on.  A
problem is one `error: ...` line with exit code 2; nothing is written.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from torchtitan.config import main_parse
from torchtitan.config.job_config import JobConfig
from torchtitan.config.resolve import check_mesh_search_possible, resolve, resolve_model_args
from torchtitan.config.validate import validate_job_config
from torchtitan.distributed.parallel_dims import mesh_search_requested
from torchtitan.errors import UserInputError
from torchtitan.protocols.train_spec import get_train_spec, import_custom_module


def check_writable_folder(path: Path, option: str) -> None:
    """`path` is, or can be created as, a folder this process may write into.

    Nothing is left behind: the nearest existing ancestor is probed with a temporary
    file that is deleted at once (permission bits alone say nothing for root, and a
    read-only mount only shows on a write)."""
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise UserInputError(
            f"{option}: {probe} is a file, so the folder {path} cannot be created; "
            "remove the file or choose another folder"
        )
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        raise UserInputError(
            f"{option}: cannot write into {probe} ({e.strerror}); choose a writable folder"
        ) from None


def output_folders(job_config: JobConfig) -> list[tuple[Path, str]]:
    """(folder, option) for everything the run will write."""
    dump = Path(job_config.job.dump_folder)
    folders = [(dump, "--job.dump_folder")]
    if job_config.checkpoint.enable:
        folders.append((dump / job_config.checkpoint.folder, "--checkpoint.folder"))
    if job_config.metrics.enable_tensorboard:
        folders.append((dump / job_config.metrics.save_tb_folder, "--metrics.save_tb_folder"))
    return folders


def check(job_config: JobConfig, world_size: int) -> str:
    """Raise `UserInputError` for the first problem; else a line saying what was checked.
    The mesh and batch are resolved as the trainer resolves them (`config.resolve`)."""
    from torchtitan.datasets import check_dataset
    from torchtitan.distributed.inductor_comms import inductor_settings

    validate_job_config(job_config)
    import_custom_module(job_config.experimental.custom_import)
    inductor_settings(job_config.compile)
    spec = get_train_spec(job_config.model.name)
    tokenizer = spec.build_tokenizer_fn(job_config)
    model_args = resolve_model_args(spec, job_config, tokenizer)
    if mesh_search_requested(job_config.parallelism):
        # the mesh (and with it the batch split) is the spec's mesh search's, at start
        check_mesh_search_possible(spec, job_config.parallelism, world_size)
        mesh = "auto (the spec's mesh search plans every candidate at start)"
    else:
        mesh = resolve(spec, job_config, model_args, world_size).mesh_label()
    data = check_dataset(job_config.training)
    for folder, option in output_folders(job_config):
        check_writable_folder(folder, option)
    return f"preflight: mesh {mesh}, data {data}"


def main(argv: list[str]) -> None:
    if "--world-size" not in argv:
        print("error: preflight needs --world-size N", file=sys.stderr)
        sys.exit(2)
    i = argv.index("--world-size")
    world_size = int(argv[i + 1])
    job_config = main_parse(argv[:i] + argv[i + 2 :])
    try:
        print(check(job_config, world_size))
    except UserInputError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main(sys.argv[1:])
