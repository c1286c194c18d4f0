"""Check a job's configuration once, before any rank starts.

`run_train.sh` runs `python -m torchtitan.preflight --world-size N <train args>`: it
parses the config, checks the mesh degrees against the world size, resolves the model
name and flavor, loads the tokenizer and opens the dataset, exactly as a rank would.  A
problem is reported as one `error: ...` line with exit code 2, instead of one traceback
per rank from torchrun.
"""

from __future__ import annotations

import sys

from torchtitan.config import main_parse
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.errors import UserInputError
from torchtitan.protocols.train_spec import get_train_spec


def check(job_config, world_size: int) -> None:
    from torchtitan.train import grad_accumulation_steps, resolve_model_args

    from torchtitan.distributed.inductor_comms import inductor_settings

    dims = ParallelDims.from_config(job_config.parallelism, world_size)
    inductor_settings(job_config.compile)
    spec = get_train_spec(job_config.model.name)
    tokenizer = spec.build_tokenizer_fn(job_config)
    resolve_model_args(spec, job_config, tokenizer)
    grad_accumulation_steps(job_config.training, dims.dp_degree)
    spec.build_dataloader_fn(dims.dp_degree, 0, tokenizer, job_config)


def main(argv: list[str]) -> None:
    if "--world-size" not in argv:
        print("error: preflight needs --world-size N", file=sys.stderr)
        sys.exit(2)
    i = argv.index("--world-size")
    world_size = int(argv[i + 1])
    job_config = main_parse(argv[:i] + argv[i + 2:])
    try:
        check(job_config, world_size)
    except UserInputError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main(sys.argv[1:])
