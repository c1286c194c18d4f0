"""`every_value_initialised`: an init that leaves a parameter or buffer untouched after
`to_empty` is named, instead of training from whatever memory was handed out."""

import pytest
import torch
import torch.nn as nn

from torchtitan.distributed.init_check import every_value_initialised
from torchtitan.errors import UserInputError


class Partial(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.register_buffer("table", torch.zeros(3))
        self.register_buffer("steps", torch.zeros(3, dtype=torch.long))  # not floating: skipped

    def init_weights(self, skip_b: bool):
        nn.init.normal_(self.a.weight)
        nn.init.zeros_(self.a.bias)
        if not skip_b:
            nn.init.normal_(self.b.weight)
            nn.init.zeros_(self.b.bias)
        self.table = torch.arange(3.0)  # reassigning a buffer counts as initialising it


def materialised() -> Partial:
    with torch.device("meta"):
        model = Partial()
    return model.to_empty(device="cpu")


def test_complete_init_passes():
    model = materialised()
    with every_value_initialised(model):
        model.init_weights(skip_b=False)
    assert not any(torch.isnan(p).any() for p in model.parameters())


def test_untouched_parameters_are_named():
    model = materialised()
    with pytest.raises(UserInputError, match=r"init_weights left b\.weight, b\.bias uninitialised"):
        with every_value_initialised(model):
            model.init_weights(skip_b=True)
