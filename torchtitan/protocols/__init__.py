from torchtitan.protocols.model import BaseModelArgs, ModelProtocol
from torchtitan.protocols.train_spec import (
    TrainSpec,
    get_train_spec,
    register_train_spec,
    registered_names,
)

__all__ = [
    "BaseModelArgs",
    "ModelProtocol",
    "TrainSpec",
    "get_train_spec",
    "register_train_spec",
    "registered_names",
]
