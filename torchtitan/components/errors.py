"""Errors shared by the trainer's components."""

from torchtitan.errors import UserInputError


class AssetError(UserInputError):
    """A required asset (tokenizer, dataset) is missing or unreachable.

    The message is one line naming what was looked for and how to fix it; as a
    ``UserInputError`` (a ``ValueError``) the entry points print it instead of a traceback.
    """
