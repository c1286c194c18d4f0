"""Hugging Face causal LMs from a local config (model side only; no parallelism here)."""

from collections.abc import Iterator, Mapping

from torchtitan.models.hf_causal_lm.model import HFModelArgs, build_hf_causal_lm, config_file

__all__ = ["HFConfigFlavors", "HFModelArgs", "build_hf_causal_lm"]


class HFConfigFlavors(Mapping):
    """The flavors of a Hugging Face spec: every local config path is one (`--model.flavor
    ./path/to/config_folder`); a path that holds no config is a clear error."""

    example = "./tests/assets/hf_llama_debug"

    def __getitem__(self, path: str) -> HFModelArgs:
        config_file(path)  # raises the user-facing error
        return HFModelArgs(config_path=path)

    def __contains__(self, path: object) -> bool:
        return isinstance(path, str)  # __getitem__ explains a bad path

    def __iter__(self) -> Iterator[str]:
        return iter([self.example])

    def __len__(self) -> int:
        return 1
