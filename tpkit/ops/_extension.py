"""The CUDA kernels of ``csrc/`` (paged attention, the cache write, the decode linear, RoPE, SwiGLU and the
float8 activation quantizations), compiled on first use.

The extension is built with ``torch.utils.cpp_extension.load`` (ninja) for the compute capability of the
GPU it runs on, and cached per (GPU architecture, torch version, CUDA version) in
``$TORCH_EXTENSIONS_DIR/<name>`` (default ``~/.cache/torch_extensions/<name>``); later processes reuse
the build. Compile flags: ``-O3 -std=c++17 -gencode=arch=compute_XY,code=sm_XY`` for the device's
``sm_XY`` (8.0 or newer: the kernels use ``cp.async``, ``ldmatrix`` and bf16 ``mma.sync``).

Ahead-of-time build, for machines whose users have torch but no CUDA toolkit: on a machine with ``nvcc``
(matching ``torch.version.cuda``) and the same torch, run::

    python -m tpkit.ops.build                 # for the visible GPUs
    python -m tpkit.ops.build --arch 8.0 9.0  # for named architectures, no GPU needed

then ship the printed directories and point ``TORCH_EXTENSIONS_DIR`` at their parent. Where ``nvcc`` is
missing, the ops load such a prebuilt module directly.

The entry points return False when no kernel can be had on this machine (no toolkit and no prebuilt
module, a failed compile, a GPU older than sm_80); they then warn once saying how to get the kernel, and
the op's CUDA implementation (:mod:`tpkit.ops._library`) runs its PyTorch implementation instead.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import re
import threading
import warnings
from pathlib import Path
from types import ModuleType

import torch

_CSRC = Path(__file__).resolve().parent.parent / "csrc"
# The torch binding and every kernel family's sources (csrc/<topic>/*.cu).
_SOURCES = ("binding.cpp", *sorted(str(path.relative_to(_CSRC)) for path in _CSRC.glob("*/*.cu")))
_MIN_CAPABILITY = (8, 0)

# tpkit_dtype codes of csrc/common/dtype.h
_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
# tpkit_fp8_format codes of csrc/common/dtype.h
_FP8_CODES = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}

_lock = threading.Lock()
_modules: dict[tuple[int, int], ModuleType | None] = {}  # by compute capability
# By CUDA device index: a device's capability does not change, and asking torch for it again costs more host
# time than an eager decode step's small kernels take.
_device_modules: dict[int, ModuleType | None] = {}
_warned = False


def extension_name(capability: tuple[int, int]) -> str:
    """Module name of the build for one GPU architecture under this torch and CUDA version."""
    torch_version = re.sub(r"[^0-9a-zA-Z]+", "_", torch.__version__.split("+")[0])
    cuda_version = re.sub(r"[^0-9a-zA-Z]+", "_", torch.version.cuda or "none")
    return f"tpkit_kernels_sm{capability[0]}{capability[1]}_torch{torch_version}_cu{cuda_version}"


def build_root() -> Path:
    """Where builds are cached: ``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(root) if root else Path.home() / ".cache" / "torch_extensions"


def arch_flags(capability: tuple[int, int]) -> list[str]:
    """nvcc's target for one architecture: on compute 9.0 (H100, H200) sm_90a, whose warpgroup products
    (wgmma) the large-group kernel uses, with ``TPKIT_SM90A`` defined; else sm_XY."""
    if capability == (9, 0):
        return ["-gencode=arch=compute_90a,code=sm_90a", "-DTPKIT_SM90A"]
    arch = f"{capability[0]}{capability[1]}"
    return [f"-gencode=arch=compute_{arch},code=sm_{arch}"]


def compile_flags(capability: tuple[int, int]) -> list[str]:
    """nvcc flags for one architecture (naming it stops torch from adding its own ``-gencode`` list)."""
    return ["-O3", "-std=c++17", *arch_flags(capability), "-lineinfo"]


def build(capability: tuple[int, int], *, verbose: bool = False) -> ModuleType:
    """Compiles (or reuses, when up to date) the extension for ``capability``; raises on failure."""
    from torch.utils.cpp_extension import load

    name = extension_name(capability)
    build_dir = build_root() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    return load(
        name=name,
        sources=[str(_CSRC / s) for s in _SOURCES],
        extra_cflags=["-O3", "-std=c++17"],
        extra_cuda_cflags=compile_flags(capability),
        extra_include_paths=[str(_CSRC)],
        build_directory=str(build_dir),
        verbose=verbose,
    )


def _load_prebuilt(capability: tuple[int, int]) -> ModuleType | None:
    name = extension_name(capability)
    build_dir = build_root() / name
    for suffix in importlib.machinery.EXTENSION_SUFFIXES + [".so"]:
        path = build_dir / f"{name}{suffix}"
        if path.is_file():
            spec = importlib.util.spec_from_file_location(name, path)
            if spec is None or spec.loader is None:
                return None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    return None


def _warn_once(reason: str) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(
        f"tpkit: the CUDA kernels (paged attention, decode linear) are not available ({reason}); using the "
        f"slower PyTorch implementations. For the fast kernels, install the CUDA toolkit matching torch "
        f"(CUDA {torch.version.cuda}: nvcc on PATH or CUDA_HOME set; it compiles on first use), or build it "
        f"ahead of time with `python -m tpkit.ops.build` on a machine that has the toolkit and set "
        f"TORCH_EXTENSIONS_DIR to the directory holding the result.",
        RuntimeWarning,
        stacklevel=3,
    )


def _find_module(capability: tuple[int, int]) -> ModuleType | None:
    from torch.utils.cpp_extension import CUDA_HOME

    if capability < _MIN_CAPABILITY:
        _warn_once(f"GPU compute capability {capability[0]}.{capability[1]} is below 8.0")
        return None
    if CUDA_HOME is None:
        module = _load_prebuilt(capability)
        if module is None:
            _warn_once("no CUDA toolkit (nvcc) found and no prebuilt module in "
                       f"{build_root() / extension_name(capability)}")
        return module
    try:
        return build(capability)
    except Exception as exc:  # a compiler or toolkit error: fall back, never fail the caller
        module = _load_prebuilt(capability)
        if module is None:
            _warn_once(f"building the extension failed: {type(exc).__name__}: {exc}")
        return module


def _module_for(device: torch.device) -> ModuleType | None:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _device_modules:
        return _device_modules[index]
    capability = torch.cuda.get_device_capability(index)
    with _lock:
        if capability not in _modules:
            _modules[capability] = _find_module(capability)
        _device_modules[index] = _modules[capability]
        return _modules[capability]


def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    alibi_slopes: torch.Tensor | None,
    query_start_loc: torch.Tensor | None = None,
    causal: bool = True,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window_size: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> bool:
    """Runs the CUDA attention kernel into ``out``; False when no kernel is available here.

    query, out ``[num_seqs, num_heads, head_size]`` (decode) or, with int32 ``query_start_loc``
    ``[num_seqs + 1]``, ``[num_tokens, num_heads, head_size]``; key_cache, value_cache
    ``[num_blocks, block_size, num_kv_heads, head_size]``; block_tables int32
    ``[num_seqs, max_blocks_per_seq]``; seq_lens int32 ``[num_seqs]``; alibi_slopes float32 ``[num_heads]``
    or None. Raises ValueError for a configuration the kernel does not support (the message lists what
    is). No host synchronisation and no allocation that depends on values: safe in CUDA graphs.

    ``window_size``, ``logits_soft_cap`` and ``sinks`` (float32 ``[num_heads]``) as for the op.

    A float8 cache (``k_scale``, ``v_scale`` float32 ``[]`` or ``[num_kv_heads]``) runs the kernel under
    float16 and bfloat16 queries of head sizes that are multiples of 16; elsewhere False, and the PyTorch
    implementation dequantizes it on the GPU.
    """
    module = _module_for(query.device)
    if module is None:
        return False
    head_size, block_size = query.shape[-1], key_cache.shape[1]
    dtype_code = _DTYPE_CODES.get(query.dtype, -1)
    if k_scale is not None:
        if not module.is_supported(dtype_code, head_size, block_size, _FP8_CODES[key_cache.dtype]):
            return False
    elif not module.is_supported(dtype_code, head_size, block_size):
        raise ValueError(f"paged_attention (CUDA): dtype {query.dtype}, head_size {head_size} and block_size "
                         f"{block_size} are not supported; supported: {module.supported_text()}")
    module.paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens, float(scale),
                           alibi_slopes, query_start_loc, causal, k_scale, v_scale, window_size,
                           logits_soft_cap, sinks)
    return True


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> bool:
    """Writes key/value ``[num_tokens, num_kv_heads, head_size]`` into their cache slots (int64
    ``slot_mapping``, negative = skip) with the CUDA kernel; False when no kernel is available here. With
    ``k_scale`` and ``v_scale`` (float32 ``[]`` or ``[num_kv_heads]``) the float8 caches get
    ``saturate(x / scale)``."""
    module = _module_for(key.device)
    if module is None:
        return False
    module.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    return True


def launch_plan(query: torch.Tensor, key_cache: torch.Tensor, block_tables: torch.Tensor,
                query_start_loc: torch.Tensor | None = None, causal: bool = True,
                window_size: int | None = None) -> dict[str, int] | None:
    """The kernel's launch configuration for these shapes (split-K partitions, warps, pipeline stages,
    shared memory, the query tokens of a work tile ``tile_tokens``, and the attention grid: ``grid_x``,
    ``grid_y``, ``grid_z``, ``cluster_size``), as benchmarks report it; None when no kernel is available
    here. Planning reads only the shapes (and the device, and ``window_size`` with ``causal``: a window
    bounds the keys a block reads), never ``query_start_loc``'s values, so expanded (stride 0) tensors of
    any size serve."""
    module = _module_for(query.device)
    return None if module is None else dict(module.plan(query, key_cache, block_tables, query_start_loc,
                                                        causal, window_size))


def device_limits(device: torch.device) -> dict[str, int] | None:
    """The CUDA device's launch limits that plans must respect (``max_grid_x/y/z``,
    ``max_threads_per_block``, ``max_smem_per_block_optin``, ``cluster_launch``, ``multiprocessors``,
    ``major``, ``minor``), read from the CUDA runtime; None when no kernel is available here."""
    module = _module_for(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return None if module is None else dict(module.device_limits(index))


def decode_linear(
    out: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    splits: int = 0,
    silu_and_mul: bool = False,
    rms_sums: torch.Tensor | None = None,
    eps: float = 0.0,
    weight_scale: torch.Tensor | None = None,
) -> bool:
    """``out = input @ weight.T (+ bias)`` with the decode linear kernel; False where no kernel is available
    here or the kernel does not take these tensors (float16 or bfloat16, at most 16 rows, ``in_features`` a
    multiple of 32 and ``out_features`` of 8, rows 16-byte aligned), for the caller to fall back.

    input ``[num_rows, in_features]``, weight ``[out_features, in_features]``, bias ``[out_features]`` or
    None, out ``[num_rows, out_features]``. ``splits``: warps that share a weight row (1, 2, 4 or 8; 0
    chooses from the shapes), for benchmarks. ``silu_and_mul``: the weight stacks a gate's rows over an up
    projection's, and out ``[num_rows, out_features / 2]`` gets ``silu(gate) * up``. ``rms_sums`` (float64
    ``[num_rows]``, or None): the second half of an RMSNorm split across two products, each row's product
    multiplied by ``rsqrt(rms_sums[m] / in_features + eps)`` before the bias (see
    :func:`decode_linear_residual_norm`). ``weight_scale`` (float32 ``[out_features]``, or None): weight is
    float8 E4M3, each row's product multiplied by its scale (as :func:`decode_linear_fp8`). No host
    synchronisation: safe in CUDA graphs.
    """
    module = _module_for(input.device)
    return module is not None and module.decode_linear(out, input, weight, bias, splits, silu_and_mul,
                                                       rms_sums, eps, weight_scale)


def decode_linear_fp8(
    out: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> bool:
    """``out = input @ (weight * weight_scale[:, None]).T (+ bias)`` with the decode linear kernel reading
    float8 (E4M3) weights; False where no kernel is available here or the kernel does not take these tensors
    (those of :func:`decode_linear`, with weight float8 and weight_scale float32 ``[out_features]``)."""
    module = _module_for(input.device)
    return module is not None and module.decode_linear_fp8(out, input, weight, weight_scale, bias)


def decode_linear_residual_norm(
    out: torch.Tensor,
    normed: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    sums: torch.Tensor,
    zero_sums: torch.Tensor | None,
    weight_scale: torch.Tensor | None = None,
) -> bool:
    """:func:`decode_linear` plus a residual and the first half of an RMSNorm of the result, in the kernel's
    epilogue: ``out = residual + input @ weight.T (+ bias)`` (the product rounded to the dtype first),
    ``normed = out * norm_weight``, ``sums[m] += (out[m].float() ** 2).sum()`` (in float64) and
    ``zero_sums`` set to zero; False where no kernel is available here or the kernel does not take these
    tensors.

    out, residual, normed ``[num_rows, out_features]``; norm_weight ``[out_features]``; sums, zero_sums
    float64 ``[num_rows]``, two distinct buffers (zero_sums may be None; the op checks that they are two,
    the kernel does not). A consumer product with
    ``rms_sums=sums`` then computes ``rms_norm(out) @ W.T`` without a norm kernel between the two.
    ``weight_scale`` as in :func:`decode_linear`.
    """
    module = _module_for(input.device)
    return module is not None and module.decode_linear_residual_norm(out, normed, input, weight, bias,
                                                                     residual, norm_weight, sums, zero_sums,
                                                                     weight_scale)


def decode_qkv_rope_cache(
    out: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    rms_sums: torch.Tensor | None = None,
    eps: float = 0.0,
    weight_scale: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> bool:
    """:func:`decode_linear` of a fused q, k, v projection with RoPE on its q and k heads and its k and v
    heads written to the caches, in the kernel's epilogue; False where no kernel is available here or the
    kernel does not take these tensors.

    out ``[num_rows, (num_heads + 2 * num_kv_heads) * head_size]``; cos, sin ``[num_rows, head_size / 2]``;
    caches ``[num_blocks, block_size, num_kv_heads, head_size]`` (written in place at ``slot_mapping``, int64
    ``[num_rows]``; a negative slot or one past the cache is skipped; a float8 cache stores
    ``saturate(x / scale)`` with ``k_scale`` and ``v_scale``, float32 ``[]`` or ``[num_kv_heads]``, as
    :func:`reshape_and_cache` does); ``rms_sums``, ``eps`` and ``weight_scale`` as in :func:`decode_linear`.
    """
    module = _module_for(input.device)
    return module is not None and module.decode_qkv_rope_cache(out, input, weight, bias, cos, sin, key_cache,
                                                               value_cache, slot_mapping, num_heads, rms_sums,
                                                               eps, weight_scale, k_scale, v_scale)


def rotary(out: torch.Tensor, input: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """RoPE of ``input`` ``[num_tokens, num_heads, head_size]`` (any token and head strides, the last
    dimension contiguous) by cos, sin ``[num_tokens, head_size / 2]`` into ``out`` (contiguous, input's
    shape), rounded as :func:`tpkit.ops.apply_rotary` rounds; False where no kernel is available here
    or it does not take these tensors (float16 or bfloat16, head_size a multiple of 16, 16-byte aligned
    rows)."""
    module = _module_for(input.device)
    return module is not None and module.rotary(out, input, cos, sin)


def silu_and_mul(out: torch.Tensor, input: torch.Tensor) -> bool:
    """``out`` ``[num_rows, features]`` = ``F.silu(gate) * up`` of ``input``'s halves ``[num_rows, 2 *
    features]``, rounded as that expression rounds; False where no kernel is available here or it does not
    take these tensors (float16 or bfloat16, features a multiple of 8, 16-byte aligned rows)."""
    module = _module_for(input.device)
    return module is not None and module.silu_and_mul(out, input)


def quantize_per_token_fp8(out: torch.Tensor, scale: torch.Tensor, input: torch.Tensor,
                           input_scale: torch.Tensor | None = None,
                           activation_scale_ub: float | None = None) -> bool:
    """``out`` (``torch.float8_e4m3fn`` ``[num_rows, features]``, contiguous) and ``scale`` (float32
    ``[num_rows, 1]``) of ``input`` ``[num_rows, features]`` quantized per token, bit for bit as
    :func:`tpkit.ops.quantize_per_token_fp8`'s PyTorch implementation on the GPU; False where no kernel is
    available here or it does not take these tensors (float16 or bfloat16, features a multiple of 8, 16-byte
    aligned rows, a float32 ``input_scale`` of one element on input's device)."""
    module = _module_for(input.device)
    return module is not None and module.quantize_per_token_fp8(out, scale, input, input_scale,
                                                                activation_scale_ub)


def silu_and_mul_quantize_fp8(out: torch.Tensor, scale: torch.Tensor, input: torch.Tensor,
                              input_scale: torch.Tensor | None = None,
                              activation_scale_ub: float | None = None) -> bool:
    """``out`` and ``scale`` of ``silu(gate) * up`` of ``input``'s halves ``[num_rows, 2 * features]``
    quantized per token, bit for bit as :func:`tpkit.ops.silu_and_mul_quantize_fp8`'s PyTorch implementation
    on the GPU; False where :func:`quantize_per_token_fp8` would be."""
    module = _module_for(input.device)
    return module is not None and module.silu_and_mul_quantize_fp8(out, scale, input, input_scale,
                                                                   activation_scale_ub)


def rms_norm_quantize_fp8(out: torch.Tensor, scale: torch.Tensor, residual_out: torch.Tensor | None,
                          input: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                          eps: float, input_scale: torch.Tensor | None = None,
                          activation_scale_ub: float | None = None) -> bool:
    """``out`` and ``scale`` of the RMSNorm of ``input`` ``[num_rows, features]`` (with ``residual``, of
    ``input + residual``, written to ``residual_out``, contiguous) by ``norm_weight`` ``[features]``,
    quantized per token as :func:`tpkit.ops.rms_norm_quantize_fp8` says; False where
    :func:`quantize_per_token_fp8` would be, or the weight or residual is not contiguous and aligned."""
    module = _module_for(input.device)
    return module is not None and module.rms_norm_quantize_fp8(out, scale, residual_out, input, residual,
                                                               norm_weight, eps, input_scale,
                                                               activation_scale_ub)
