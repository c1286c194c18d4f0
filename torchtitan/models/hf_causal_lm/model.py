"""A Hugging Face `transformers` causal LM as a trainer model: built from a local config only.

`HFModelArgs` reads a config (a folder holding `config.json`, or the file itself; nothing is
downloaded).  `build_hf_causal_lm(args)` makes the model class the config names
(`AutoModelForCausalLM`) with SDPA attention (eager where the class has no SDPA) and no KV
cache, as a subclass whose forward
takes the token ids and returns the logits — what the trainer's loss expects — so parameter
names stay Hugging Face's (checkpoints load back into `transformers`).  `init_weights()` is
the class's own (`_init_weights` per module, then weight tying).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from torchtitan.config.job_config import JobConfig
from torchtitan.errors import UserInputError
from torchtitan.ops.hf_experts import use_routed_experts
from torchtitan.protocols.model import BaseModelArgs

INSTALL_HINT = "pip install -e '.[hf]' (or: pip install transformers)"


def import_transformers():
    try:
        import transformers
    except ImportError:
        raise UserInputError(
            f"--model.name hf_auto_parallel needs the transformers package: {INSTALL_HINT}"
        ) from None
    return transformers


def config_file(path: str) -> Path:
    """`path` or `path/config.json`; a clear error for anything else (a hub id included)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise UserInputError(
            f"--model.flavor: {path!r} is not a local Hugging Face config (a folder with "
            "config.json, or the file); models are never downloaded"
        )
    return p


def _root_cause(e: BaseException) -> str:
    """The first line of the innermost cause: transformers' config validation wraps the
    actual complaint ("The hidden size (256) is not a multiple of ...") in its own error."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


@dataclass
class HFModelArgs(BaseModelArgs):
    """A Hugging Face config, read from `config_path` by `update_from_config`."""

    config_path: str = ""
    config: Any = field(default=None, repr=False)

    def update_from_config(self, job_config: JobConfig, tokenizer: Any) -> None:
        transformers = import_transformers()
        path = config_file(self.config_path)
        try:
            config = transformers.AutoConfig.from_pretrained(
                str(path.parent), local_files_only=True
            )
        except Exception as e:  # noqa: BLE001 - transformers validates with its own errors
            raise UserInputError(f"--model.flavor: cannot read {path}: {_root_cause(e)}") from None
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
            raise UserInputError(
                f"--model.flavor: {path} describes a {config.model_type!r} model, which "
                "transformers has no causal-LM class for (AutoModelForCausalLM)"
            )
        if tokenizer.vocab_size > config.vocab_size:
            raise UserInputError(
                f"--model.tokenizer_path: the tokenizer has {tokenizer.vocab_size} tokens but "
                f"{path} has vocab_size {config.vocab_size}; use a matching tokenizer or config"
            )
        max_pos = getattr(config, "max_position_embeddings", None)
        if max_pos is not None and job_config.training.seq_len > max_pos:
            raise UserInputError(
                f"--training.seq_len {job_config.training.seq_len} exceeds "
                f"max_position_embeddings {max_pos} of {path}"
            )
        config.use_cache = False
        self.config = config

    def tensor_parallel_sizes(self) -> dict[str, int]:
        """The config's head counts and widths that it states (names as in the config)."""
        names = (
            "num_attention_heads",
            "num_key_value_heads",
            "hidden_size",
            "intermediate_size",
            "vocab_size",
        )
        return {
            n: v for n in names if isinstance(v := getattr(self.config, n, None), int) and v > 0
        }

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """Parameters and training FLOPs per token, counted as for Llama 3: 6 per
        non-embedding parameter plus the attention score and value matmuls."""
        nparams = sum(p.numel() for p in model.parameters())
        # a transformers model (`build_hf_causal_lm`), whose methods nn.Module does not declare
        get_input_embeddings = cast(Callable[[], nn.Embedding], model.get_input_embeddings)
        embedding = get_input_embeddings().weight.numel()
        cfg = self.config
        layers, heads = cfg.num_hidden_layers, cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return nparams, 6 * (nparams - embedding) + 12 * layers * heads * head_dim * seq_len


@functools.cache
def _logits_class(cls: type[nn.Module]) -> type:
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return cls.forward(self, input_ids=input_ids).logits

    return type(
        cls.__name__,
        (cls,),
        {"forward": forward, "__module__": cls.__module__, "__doc__": cls.__doc__},
    )


def build_hf_causal_lm(args: HFModelArgs) -> nn.Module:
    """The config's causal-LM class (on the current default device), logits out; SDPA
    attention where the class has it, else its eager attention; SwiGLU experts through
    `titan.routed_experts`."""
    transformers = import_transformers()
    auto = transformers.AutoModelForCausalLM
    try:
        model = auto.from_config(args.config, attn_implementation="sdpa")
    except ValueError as e:
        if "scaled_dot_product_attention" not in str(e):
            raise
        model = auto.from_config(args.config, attn_implementation="eager")
    # mixture-of-experts modules run as one op the planner can split (ops/hf_experts.py)
    use_routed_experts(model)
    # a tensor some model code creates with an explicit device (diffllama's `torch.normal`
    # lambdas) joins the others; `init_weights` gives it its value later
    model.to(torch.get_default_device())
    # typed `type`: mypy takes type[Any] for unhashable (python/mypy#11470)
    model_class: type = type(model)
    model.__class__ = _logits_class(model_class)
    return model
