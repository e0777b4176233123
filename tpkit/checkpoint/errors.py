"""Errors of tpkit.checkpoint: a checkpoint that does not fit the model (or optimizer) it is loaded into."""

from __future__ import annotations

from tpkit.loaders import WeightsMismatchError


class CheckpointMismatchError(WeightsMismatchError):
    """A checkpoint and a model (or optimizer) that do not fit, every misfit in one message (the message of
    :class:`~tpkit.loaders.WeightsMismatchError`, after the checkpoint's path), raised before anything is
    loaded.

    ``problems``: tensors whose shapes differ (the name, the checkpoint's shape and the model's) and any
    other disagreement (architecture, optimizer groups, missing or truncated files); ``missing``: the model's
    tensors the checkpoint lacks; ``unexpected``: the checkpoint's model tensors the model lacks.
    """

    def __init__(self, path: str, problems: list[str], missing: list[str], unexpected: list[str]) -> None:
        super().__init__(problems, missing, unexpected)
        self.path = path
        self.args = (f"{path}: {self.args[0]}",)
