"""Runs tpkit's paged-attention op a few times per configuration, for a profiler to attach to.

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats -k regex:paged_attention \
        --launch-skip 2 --launch-count 2 python3 benchmarks/profile_paged_attention.py --only C6

The configurations, data and block tables are bench_paged_attention's; the launch plan is printed first.
"""

from __future__ import annotations

import argparse

import torch
from bench_paged_attention import CONFIGS, _make_set, _parse_config

from tpkit.attention import _cuda, paged_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=None, help="comma-separated names of the built-in configs")
    parser.add_argument("--config", action="append", type=_parse_config, default=[],
                        help="name:dtype:B:L:Hq:Hkv, repeatable")
    parser.add_argument("--calls", type=int, default=4)
    args = parser.parse_args()
    names = set(args.only.split(",")) if args.only else None
    configs = [c for c in CONFIGS if names is None or c.name in names] + args.config
    generator = torch.Generator(device="cuda").manual_seed(0)
    for cfg in configs:
        s = _make_set(cfg, generator)
        plan = _cuda.launch_plan(s.query, s.key_cache, s.block_tables)
        print(f"{cfg}: plan {plan}", flush=True)
        out = torch.empty_like(s.query)
        for _ in range(args.calls):
            paged_attention(s.query, s.key_cache, s.value_cache, s.block_tables, s.seq_lens, out=out)
        torch.cuda.synchronize()
        del s, out


if __name__ == "__main__":
    main()
