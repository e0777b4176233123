"""The ``TPKIT_*`` boolean environment flags, read one way everywhere.

Every floor of the package reads its switches through :func:`env_flag`, so ``TPKIT_DEBUG=false`` means off
wherever it is read, and a value that is neither on nor off is an error naming the variable rather than a
guess. Unset or empty means the flag's default.
"""

from __future__ import annotations

import os

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def env_flag(name: str, default: bool) -> bool:
    """The boolean environment variable ``name``: 1/true/yes/on or 0/false/no/off (any case, surrounding
    spaces ignored); ``default`` when unset or empty. Anything else raises ValueError naming the variable."""
    text = os.environ.get(name, "").strip().lower()
    if not text:
        return default
    if text in _ON:
        return True
    if text in _OFF:
        return False
    raise ValueError(f"environment variable {name}: expected one of {', '.join(_ON + _OFF)} (or unset), got "
                     f"{os.environ[name]!r}")
