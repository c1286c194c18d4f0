"""A training step of an auto-parallel module must not leave reference cycles behind.

The trainer disables automatic garbage collection (it collects every `gc_freq` steps on
all ranks at once), so anything a step keeps alive through a cycle — e.g. a closure that
references itself and the activation environment — grows memory by one step's
activations per step.  This was a real bug; the check is that after fwd+bwd the garbage
collector finds no tensors to free.
"""

import gc

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from torchtitan.autoparallel import AutoParallel
from torchtitan.models.llama3.args import TransformerModelArgs
from torchtitan.models.llama3.model import Transformer


@pytest.fixture
def one_rank_mesh(fake_world):
    with fake_world(1):
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))


def test_step_leaves_no_tensor_cycles(one_rank_mesh):
    args = TransformerModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=8)
    with torch.device("meta"):
        model = Transformer(args)
    with AutoParallel(
        model, lambda: torch.randint(0, 64, (2, 8)), one_rank_mesh, cost_model="cpu"
    ) as autop:
        autop.add_input_constraints([[Shard(0)]])
        autop.add_output_constraints([[Shard(0)]])
        parallel = autop.apply_placement(autop.optimize_placement())
    parallel.to_empty(device="cpu")
    parallel.init_weights()
    gc.collect()
    gc.disable()
    try:
        for _ in range(2):
            parallel(torch.randint(0, 64, (2, 8))).float().mean().backward()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        leaked = [o for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not leaked, f"{len(leaked)} tensors were only freeable by the garbage collector"
