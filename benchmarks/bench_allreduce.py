"""All-reduces of decode-sized messages inside a CUDA graph: NCCL against PyTorch's symmetric-memory kernels.

    torchrun --nproc-per-node 2 benchmarks/bench_allreduce.py [--batch-sizes 1,8,32] [--hidden 4096]

A Llama decode step at tp_size > 1 makes two all-reduces a layer plus one for the embedding (65 for the
8B shapes), each of ``[batch, hidden]`` bf16, with the step replayed from a CUDA graph. This captures 65
such all-reduces, each on its own buffer as a model's layers have, into one graph and reports the median
replay time per all-reduce for: ``dist.all_reduce`` (NCCL), and ``torch.ops.symm_mem``'s
``one_shot_all_reduce`` (every rank reads every peer's buffer over NVLink and sums),
``one_shot_all_reduce_copy`` (the same, the local input copied into the symmetric buffer by the kernel) and
``two_shot_all_reduce_`` (reduce-scatter, then all-gather, in place), and tpkit's
``reduce_from_tp_region`` (what the row-parallel layers call: the one-shot kernel with the copy in up to
``ONE_SHOT_MAX_BYTES``, NCCL above). Each result is checked against NCCL's on the same inputs. NVLink
multicast stays off (``multimem`` kernels are not timed).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

sys.path.insert(0, str(Path(__file__).parent))
from bench_paged_attention import _graph_time_us  # noqa: E402

from tpkit.parallel_layers import TPGroup, reduce_from_tp_region  # noqa: E402

# Without NVLink multicast (NVLS): the kernels timed here are the ones that work without it.
_NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
ALL_REDUCES_PER_STEP = 65  # Llama-3-8B: 2 a layer x 32 layers, + the vocab-parallel embedding's


def _us_each(calls: list[Callable[[], object]]) -> float:
    """Median time of one of ``calls``'s collectives, all of them captured in one CUDA graph."""
    dist.barrier()  # the ranks' replays start together
    return _graph_time_us(calls, replays=25)


def _measure(batch: int, hidden: int, device: torch.device,
             group_name: str) -> list[tuple[str, float, float]]:
    """(variant, us per all-reduce, max abs. difference from NCCL's result) for ``[batch, hidden]`` bf16."""
    ops = torch.ops.symm_mem
    generator = torch.Generator(device=device).manual_seed(dist.get_rank())
    # Small values: the graph's replays sum into the same buffers, doubling them each time.
    inputs = [torch.randn(batch, hidden, dtype=torch.bfloat16, device=device, generator=generator) * 0.01
              for _ in range(ALL_REDUCES_PER_STEP)]  # each [batch, hidden]
    expected = inputs[0].clone()
    dist.all_reduce(expected)
    nccl_buffers = [x.clone() for x in inputs]
    rows = [("nccl all_reduce", _us_each([lambda b=b: dist.all_reduce(b) for b in nccl_buffers]), 0.0)]
    symm_buffers = []
    for x in inputs:
        buffer = symm_mem.empty(batch, hidden, dtype=torch.bfloat16, device=device)
        symm_mem.rendezvous(buffer, group_name)
        buffer.copy_(x)
        symm_buffers.append(buffer)

    def error(result: torch.Tensor) -> float:
        return (result.float() - expected.float()).abs().max().item()

    one_shot_error = error(ops.one_shot_all_reduce(symm_buffers[0], "sum", group_name))
    rows.append(("symm_mem one_shot_all_reduce", _us_each(
        [lambda b=b: ops.one_shot_all_reduce(b, "sum", group_name) for b in symm_buffers]), one_shot_error))
    copy_error = error(ops.one_shot_all_reduce_copy(symm_buffers[1], inputs[0], "sum", group_name))
    rows.append(("symm_mem one_shot_all_reduce_copy", _us_each(
        [lambda b=b, x=x: ops.one_shot_all_reduce_copy(b, x, "sum", group_name)
         for b, x in zip(symm_buffers, inputs, strict=True)]), copy_error))
    # What the row-parallel layers run: the one-shot kernel up to ONE_SHOT_MAX_BYTES, NCCL above.
    tp = TPGroup(dist.group.WORLD, dist.get_rank(), dist.get_world_size(), "nccl")
    layers_error = error(reduce_from_tp_region(inputs[0], tp))
    rows.append(("tpkit reduce_from_tp_region", _us_each(
        [lambda x=x: reduce_from_tp_region(x, tp) for x in inputs]), layers_error))
    two_shot = symm_buffers[2]
    two_shot.copy_(inputs[0])
    two_shot_error = error(ops.two_shot_all_reduce_(two_shot, "sum", group_name))
    rows.append(("symm_mem two_shot_all_reduce_", _us_each(
        [lambda b=b: ops.two_shot_all_reduce_(b, "sum", group_name) for b in symm_buffers]), two_shot_error))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--hidden", type=int, default=4096)
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ or not torch.cuda.is_available():
        parser.error("run under torchrun with a GPU a rank: torchrun --nproc-per-node 2 ...")
    os.environ.update(_NO_MULTICAST)
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    group_name = dist.group.WORLD.group_name
    try:
        rows = [(batch, *row) for batch in args.batch_sizes for row in _measure(batch, args.hidden, device,
                                                                                 group_name)]
        if dist.get_rank() == 0:
            print(f"{dist.get_world_size()} ranks, torch {torch.__version__}, "
                  f"NCCL {torch.cuda.nccl.version()}, {torch.cuda.get_device_name(device)}; "
                  f"{ALL_REDUCES_PER_STEP} all-reduces a graph")
            print(f"{'batch':>5} {'KB':>5}  {'variant':<36} {'us each':>8} {'vs nccl':>8} "
                  f"{'max abs err':>11}")
            nccl = {batch: us for batch, name, us, _ in rows if name == "nccl all_reduce"}
            for batch, name, us, err in rows:
                kb = batch * args.hidden * 2 // 1024
                print(f"{batch:>5} {kb:>5}  {name:<36} {us:>8.2f} {us / nccl[batch]:>8.2f} {err:>11.1e}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
