"""Errors of the loaders: what was wrong with a checkpoint, or between a checkpoint and a model."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be read: corrupt or truncated files, an unsafe index, unsupported contents."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint where we looked: a missing directory, no weight files, a model id not in the cache."""


class WeightsMismatchError(ValueError):
    """Checkpoint tensors and model parameters that do not pair up, all of them in one message.

    ``problems``: tensors that cannot go into their parameter (shape, dtype, two tensors for one place);
    ``missing``: model parameters no tensor loads (with the shards still missing for stacked ones);
    ``unexpected``: checkpoint tensors that match no parameter.
    """

    def __init__(self, problems: list[str], missing: list[str], unexpected: list[str]) -> None:
        self.problems = problems
        self.missing = missing
        self.unexpected = unexpected
        sections = [(f"{len(problems)} tensor(s) that cannot be loaded", problems),
                    (f"{len(missing)} model parameter(s) not in the checkpoint", missing),
                    (f"{len(unexpected)} checkpoint tensor(s) that match no parameter", unexpected)]
        lines = ["checkpoint and model do not match; nothing was loaded:"]
        for title, items in sections:
            if items:
                lines.append(f"  {title}:")
                lines.extend(f"    {item}" for item in items)
        super().__init__("\n".join(lines))


class PartialLoadError(RuntimeError):
    """Loading failed after some parameters were written: the model holds a mix of new and old values.

    ``written`` of ``total`` checkpoint tensors were copied in before the failure (``__cause__``).
    """

    def __init__(self, written: int, total: int, error: BaseException) -> None:
        self.written = written
        self.total = total
        super().__init__(f"load_weights failed after writing {written} of {total} checkpoint tensors: the "
                         f"model is partially loaded (load it again, or build it anew): "
                         f"{type(error).__name__}: {error}")
