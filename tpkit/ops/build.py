"""Ahead-of-time build of tpkit's CUDA kernels.

Run on a machine with the CUDA toolkit (``nvcc`` matching ``torch.version.cuda``) and the torch version the
users have::

    python -m tpkit.ops.build                 # for the architectures of the visible GPUs
    python -m tpkit.ops.build --arch 8.0 9.0  # for named architectures, no GPU needed

Each architecture gets its own module under ``$TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``); the directories printed are what to ship. On the target machine, set
``TORCH_EXTENSIONS_DIR`` to their parent: ``tpkit.ops`` then loads the prebuilt module even without
``nvcc``.
"""

from __future__ import annotations

import argparse
import sys

import torch

from tpkit.ops import _extension


def _parse_arch(text: str) -> tuple[int, int]:
    try:
        major, minor = (int(x) for x in text.split("."))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an architecture like 9.0, got {text!r}") from None
    return major, minor


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", nargs="+", type=_parse_arch, default=None,
                        help="compute capabilities to build for (default: those of the visible GPUs)")
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)
    if args.arch is not None:
        archs = args.arch
    elif torch.cuda.is_available():
        archs = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    else:
        parser.error("no GPU visible: name the architectures with --arch (e.g. --arch 8.0 9.0)")
    for capability in archs:
        if capability < (8, 0):
            parser.error(f"the kernels need compute capability 8.0 or newer, got "
                         f"{capability[0]}.{capability[1]}")
        _extension.build(capability, verbose=args.verbose)
        print(_extension.build_root() / _extension.extension_name(capability))
    return 0


if __name__ == "__main__":
    sys.exit(main())
