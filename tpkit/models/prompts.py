"""Checks of what a user hands to generation: prompts, input ids, EOS ids, and the right-padded batch."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch

Prompts = Sequence[Sequence[int]] | torch.Tensor


def parse_eos_token_ids(value: Any) -> tuple[int, ...]:
    """``eos_token_id`` of a config.json or generation_config.json (an int, a list of ints or null) as a
    tuple; anything else (``"12"``, ``12.0``, ``true``) is a ValueError."""
    if value is None:
        return ()
    ids = list(value) if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ids):
        raise ValueError(f"eos_token_id: expected a token id (an int >= 0), a list of them or null, got "
                         f"{value!r}")
    return tuple(ids)


def check_prompts(prompts: Prompts, vocab_size: int) -> list[list[int]]:
    """Validate a batch of prompts (token-id lists, or a 2-D integer tensor) and return it as lists."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2 or prompts.dtype.is_floating_point or prompts.dtype == torch.bool:
            raise ValueError(f"prompts as a tensor must be 2-D integer [batch, seq], got {prompts.dtype} "
                             f"{tuple(prompts.shape)}")
        token_lists = prompts.tolist()
    elif isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a list of token-id lists or a 2-D tensor, got "
                        f"{type(prompts).__name__}")
    else:
        token_lists = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, torch.Tensor) and prompt.dim() == 1:
                prompt = prompt.tolist()
            if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
                raise TypeError(f"prompts[{i}] must be a list of token ids, got {type(prompt).__name__}")
            token_lists.append(list(prompt))
    if not token_lists:
        raise ValueError("prompts is empty: expected at least one prompt")
    for i, ids in enumerate(token_lists):
        if not ids:
            raise ValueError(f"prompts[{i}] is empty: every prompt needs at least one token")
        token_lists[i] = ids = [_as_token_id(t, i) for t in ids]
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompts[{i}] has token ids outside [0, {vocab_size}): {bad[:5]}")
    return token_lists


def _as_token_id(token: Any, prompt_index: int) -> int:
    # operator.index takes Python, NumPy and 0-d tensor integers alike, and refuses floats.
    try:
        if isinstance(token, bool):
            raise TypeError
        return operator.index(token)
    except TypeError:
        raise TypeError(f"prompts[{prompt_index}] must hold integer token ids, got {token!r}") from None


def check_input_ids(name: str, input_ids: object, max_positions: int, key: str) -> None:
    """A full forward's ``input_ids``: a ``[batch, seq]`` tensor of at most ``max_positions`` (config
    ``key``) tokens a sequence; the embedding checks the ids themselves."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = list(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"{name}: expected a [batch, seq] tensor of token ids, got {shape}")
    if input_ids.shape[1] > max_positions:
        raise ValueError(f"{name}: expected at most {max_positions} tokens a sequence (the model's {key}), "
                         f"got {input_ids.shape[1]}")
