"""The one registration path of tpkit's ops: ``torch.ops.tpkit.<name>``, each with a PyTorch implementation,
a CUDA implementation and a fake one.

- The default implementation (the CPU's, and any device's without a kernel of its own) is the op's PyTorch
  reference, the expression its kernel is tested against.
- The CUDA implementation runs the kernel (:mod:`tpkit.ops._extension`) and, where none can run here (no
  toolkit, no prebuilt module, an old GPU: the extension warns once) or the kernel does not take these
  tensors, the reference on the GPU.
- The fake implementation gives ``torch.compile`` the results' shapes without running anything.

An op writes into arguments its schema marks ``Tensor(a!)`` (in place: the caches, ``out``) and returns new
tensors where its schema says so (a functional op: the products). Ops are defined through
``torch.library.Library`` rather than ``torch.library.custom_op``, whose Python dispatch layer costs host time
on every call, which an eager decode step pays several times a layer. What custom_op would do besides is
done here: a kernel writes through raw pointers, so the CUDA implementation bumps the version counters of
the tensors it wrote, as the reference's in-place ops do, and autograd sees the mutation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tpkit.ops import _extension
from tpkit.ops._checks import _debug_enabled

_lib = torch.library.Library("tpkit", "DEF")

Results = torch.Tensor | tuple[torch.Tensor, ...] | None


def _define_op(
    name: str,
    schema: str,
    mutates_args: tuple[str, ...],
    check: Callable[..., None] | None,
    reference: Callable[..., Results],
    *,
    kernel: Callable[..., bool] | None = None,
    outputs: Callable[..., tuple[torch.Tensor, ...]] | None = None,
    check_fake: bool = True,
    tags: tuple[torch.Tag, ...] = (),
) -> None:
    """Defines ``tpkit::<name><schema>`` with its default, CUDA and fake implementations.

    Every function takes the op's arguments in schema order, those with defaults that the caller left out
    left out (the dispatcher passes only what it was given): give them the schema's defaults.

    Args:
        mutates_args: the arguments the op writes in place (those the schema marks ``Tensor(a!)``).
        check: ``check(*args, read_values=...)`` validates the arguments before anything is written,
            reading device memory only with ``read_values`` (``TPKIT_DEBUG=1``); run by every
            implementation, the fake one too (so that ``torch.compile`` reports bad shapes while tracing)
            unless ``check_fake`` is False (a check of real tensors only, such as which buffers they are).
        reference: the PyTorch implementation; returns what the op returns.
        kernel: ``kernel(*outputs, *args) -> bool``, the CUDA kernel writing ``outputs`` and the arguments
            in ``mutates_args``; False, having written nothing, where it does not run here. By default
            ``tpkit.ops._extension.<name>``.
        outputs: the new tensors a functional op returns, allocated from the arguments' shapes (the fake
            implementation's results, the kernel's outputs); None for an op that returns nothing.
        tags: the op's tags (``torch.Tag.flexible_layout``: inductor hands it its inputs as laid out).
    """
    mutated = [i for i, arg in enumerate(_schema_args(schema)) if arg in mutates_args]
    run_kernel = kernel or getattr(_extension, name)
    allocate = outputs or (lambda *args: ())

    def validate(args: tuple, read_values: bool) -> None:
        if check is not None:
            check(*args, read_values=read_values)

    def default_impl(*args: object) -> Results:
        validate(args, _debug_enabled())
        return reference(*args)

    def cuda_impl(*args: object) -> Results:
        validate(args, _debug_enabled())
        results = allocate(*args)
        if not run_kernel(*results, *args):
            return reference(*args)
        for i in mutated:
            torch.autograd.graph.increment_version(args[i])
        return _returned(results)

    def fake_impl(*args: object) -> Results:
        if check_fake:
            validate(args, False)
        return _returned(allocate(*args))

    _lib.define(name + schema, tags=(torch.Tag.pt2_compliant_tag, *tags))
    _lib.impl(name, default_impl, "CompositeExplicitAutograd")
    _lib.impl(name, cuda_impl, "CUDA")
    torch.library.register_fake(f"tpkit::{name}", fake_impl, lib=_lib)


def _returned(results: tuple[torch.Tensor, ...]) -> Results:
    """What the op returns: nothing, one tensor or a tuple, as its outputs are."""
    if not results:
        return None
    return results[0] if len(results) == 1 else results


def _schema_args(schema: str) -> list[str]:
    """Argument names of a schema ``(Type name, ...) -> ...``, in order."""
    inside = schema[schema.index("(") + 1:schema.index(") ->")]
    return [arg.split("=")[0].split()[-1] for arg in inside.split(",")]
