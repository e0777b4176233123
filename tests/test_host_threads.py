"""The host's share of a step runs on one thread: the cache's metadata for steps of thousands of tokens (a
prefill, a chunked prefill beside decodes, prefix-cached prompts) enters no multi-thread OpenMP region. A
region wakes the intra-op pool, and waking it stalled the host, and the GPU behind it, by up to tens of
milliseconds a step on a many-core host. Counted by a shim over libgomp's ``GOMP_parallel`` preloaded into a
child process (compiled with the system C compiler; skipped without one or without an OpenMP torch)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
long tpkit_parallel_regions = 0;
typedef void (*gomp_parallel_t)(void (*)(void*), void*, unsigned, unsigned);
void GOMP_parallel(void (*fn)(void*), void* data, unsigned num_threads, unsigned flags) {
  static gomp_parallel_t real = 0;
  if (!real) real = (gomp_parallel_t)dlvsym(RTLD_NEXT, "GOMP_parallel", "GOMP_4.0");
  if (!real) real = (gomp_parallel_t)dlsym(RTLD_NEXT, "GOMP_parallel");
  if (num_threads != 1) __atomic_add_fetch(&tpkit_parallel_regions, 1, __ATOMIC_RELAXED);
  real(fn, data, num_threads, flags);
}
"""

# Run in the child: each cache call's multi-thread regions, as JSON; "probe" is a gather that torch splits
# over the pool, so that a shim that counts nothing fails the test rather than passing it.
_CHILD = textwrap.dedent("""
    import ctypes, json, random, sys
    import torch
    from tpkit.attention import PagedKVCache
    count = ctypes.c_long.in_dll(ctypes.CDLL(sys.argv[1]), "tpkit_parallel_regions")
    torch.set_num_threads(4)
    regions = {}
    def counted(name, fn):
        before = count.value
        result = fn()
        regions[name] = regions.get(name, 0) + count.value - before
        return result
    counted("probe", lambda: torch.arange(9)[torch.randint(0, 9, (8192,))])
    rng = random.Random(0)
    cache = PagedKVCache(1, 2048, 16, 1, 8, dtype=torch.float32, device="cpu")
    prompts = [[rng.randrange(1000) for _ in range(rng.randrange(500, 3000))] for _ in range(6)]
    prompts[1][:1024] = prompts[0][:1024]  # a shared prefix: its blocks come from the prefix cache
    for seq_id, prompt in enumerate(prompts[:3]):
        cached = counted("add_sequence", lambda: cache.add_sequence(seq_id, prompt))
        counted("append_slots", lambda: cache.append_slots([seq_id], [len(prompt) - cached],
                                                           token_ids=[prompt[cached:]]))
    counted("step_metadata", lambda: cache.step_metadata([0, 1, 2], [len(p) for p in prompts[:3]]))
    counted("prefill_metadata", lambda: cache.prefill_metadata([3, 4], [len(p) for p in prompts[3:5]]))
    for _ in range(3):
        counted("decode_metadata", lambda: cache.decode_metadata([0, 1, 2, 3, 4]))
    # A chunked prefill beside decodes: one sequence's next 4000 tokens, four sequences' next token.
    counted("add_sequence", lambda: cache.add_sequence(5))
    counted("append_slots", lambda: cache.append_slots([0, 1, 2, 3, 5], [1, 1, 1, 1, 4000]))
    counted("step_metadata", lambda: cache.step_metadata([0, 1, 2, 3, 5], [1, 1, 1, 1, 4000]))
    counted("truncate", lambda: cache.truncate(5, 100))
    print(json.dumps(regions))
""")


def _openmp_torch() -> bool:
    return "OpenMP" in torch.__config__.parallel_info() and sys.platform.startswith("linux")


@pytest.mark.skipif(not _openmp_torch(), reason="needs torch's OpenMP intra-op pool on Linux")
def test_cache_metadata_of_thousands_of_tokens_stays_on_one_thread(tmp_path):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("needs a C compiler for the libgomp shim")
    source, shim = tmp_path / "shim.c", tmp_path / "shim.so"
    source.write_text(_SHIM)
    subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(shim), str(source), "-ldl"], check=True,
                   timeout=60)
    env = dict(os.environ, LD_PRELOAD=str(shim), OMP_NUM_THREADS="4")
    child = subprocess.run([sys.executable, "-c", _CHILD, str(shim)], env=env, capture_output=True, text=True,
                           timeout=120)
    assert child.returncode == 0, child.stderr
    regions = json.loads(child.stdout.strip().splitlines()[-1])
    assert regions.pop("probe") > 0, "the shim counted no region of a gather torch splits over its pool"
    assert regions == dict.fromkeys(regions, 0), regions
