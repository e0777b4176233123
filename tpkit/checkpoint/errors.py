"""Errors of tpkit.checkpoint: a checkpoint that does not fit the model (or optimizer) it is loaded into."""

from __future__ import annotations


class CheckpointMismatchError(ValueError):
    """A checkpoint and a model (or optimizer) that do not fit, every misfit in one message, raised before
    anything is loaded.

    ``problems``: tensors whose shapes differ (the name, the checkpoint's shape and the model's), and any
    other disagreement (architecture, optimizer groups, missing or truncated files); ``missing``: the model's
    tensors the checkpoint lacks; ``unexpected``: the checkpoint's model tensors the model lacks.
    """

    def __init__(self, path: str, problems: list[str], missing: list[str], unexpected: list[str]) -> None:
        self.problems = problems
        self.missing = missing
        self.unexpected = unexpected
        sections = [(f"{len(problems)} mismatch(es)", problems),
                    (f"{len(missing)} model tensor(s) not in the checkpoint", missing),
                    (f"{len(unexpected)} checkpoint tensor(s) the model does not have", unexpected)]
        lines = [f"checkpoint {path} does not fit the model; nothing was loaded:"]
        for title, items in sections:
            if items:
                lines.append(f"  {title}:")
                lines.extend(f"    {item}" for item in items)
        super().__init__("\n".join(lines))
