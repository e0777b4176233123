"""Runs tpkit's paged-attention op (or a torch SDPA backend on the same K/V made contiguous) a few times per
configuration, for a profiler to attach to.

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats -k regex:paged_attention \
        --launch-skip 2 --launch-count 2 python3 tools/profile_paged_attention.py --only C6
    ncu --clock-control none --metrics dram__sectors_read.sum,lts__t_sectors_srcunit_tex_op_read.sum \
        -k regex:cudnn --launch-skip 2 --launch-count 1 \
        python3 tools/profile_paged_attention.py --only C1 --impl sdpa-cudnn

The configurations, data and block tables are bench_paged_attention's; tpkit's launch plan is printed first.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from tpkit.ops import _extension, paged_attention

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from bench_paged_attention import (  # noqa: E402
    CONFIGS,
    SDPA_BACKENDS,
    _gather,
    _make_set,
    _parse_config,
    _sdpa_call,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=None, help="comma-separated names of the built-in configs")
    parser.add_argument("--config", action="append", type=_parse_config, default=[],
                        help="name:dtype:B:L:Hq:Hkv, repeatable")
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--impl", default="tpkit", choices=["tpkit", *SDPA_BACKENDS],
                        help="tpkit's op on the paged cache, or an SDPA backend on contiguous K/V")
    args = parser.parse_args()
    names = set(args.only.split(",")) if args.only else None
    configs = [c for c in CONFIGS if names is None or c.name in names] + args.config
    generator = torch.Generator(device="cuda").manual_seed(0)
    for cfg in configs:
        s = _make_set(cfg, generator)
        if args.impl == "tpkit":
            print(f"{cfg}: plan {_extension.launch_plan(s.query, s.key_cache, s.block_tables)}", flush=True)
            out = torch.empty_like(s.query)
            for _ in range(args.calls):
                paged_attention(s.query, s.key_cache, s.value_cache, s.block_tables, s.seq_lens, out=out)
        else:
            print(f"{cfg}: {args.impl} on contiguous K/V", flush=True)
            s.key = _gather(s.key_cache, s.block_tables).contiguous()  # [B, Hkv, L, D]
            s.value = _gather(s.value_cache, s.block_tables).contiguous()
            run = _sdpa_call(s, SDPA_BACKENDS[args.impl])
            for _ in range(args.calls):
                run()
        torch.cuda.synchronize()
        del s


if __name__ == "__main__":
    main()
