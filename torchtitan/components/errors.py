"""Errors shared by the trainer's components."""


class AssetError(ValueError):
    """A required asset (tokenizer, dataset) is missing or unreachable.

    The message names what was looked for and how to fix it, so it can be shown to the
    user as-is instead of a traceback from deep inside a third-party library.
    """
