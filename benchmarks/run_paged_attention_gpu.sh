#!/usr/bin/env bash
# One call on the GPU machine (device tool): JIT-build the extension, run its CUDA tests (paged attention,
# the cache write, the decode linear), a compute-sanitizer memcheck of a few configurations, and the
# paged-attention benchmark. Logs and the JSON go to $OUT.
#   STAGES="build tests bench sanitize" bash benchmarks/run_paged_attention_gpu.sh [bench args...]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/tpkit_extensions
OUT=${OUT:-/tmp/tpkit_gpu_out}
STAGES=${STAGES:-build tests bench sanitize}
mkdir -p "$OUT"
T=tests/test_paged_attention_cuda.py
L=tests/test_decode_linear_cuda.py
# Small, varied cases for memcheck: head 120 (k-step padding), MQA 48:1 + ALiBi, fp32, head 256,
# many sequences (no split), the cluster merge (Hopper: mma and warpgroup kernels), two-slice steps,
# swizzled rows with pad chunks, the warpgroup kernel (two warpgroups a block, in a small grid and for C6;
# small groups on long tables), a strided cache, strided query, cache writes.
SANITIZE_CASES=("$T::test_paged_attention_grid[float16-120-32-4-True]"
                "$T::test_paged_attention_grid[bfloat16-128-16-48-True]"
                "$T::test_paged_attention_grid[float32-80-32-8-False]"
                "$T::test_paged_attention_grid[bfloat16-256-32-1-False]"
                "$T::test_paged_attention_many_sequences_no_split[torch.bfloat16]"
                "$T::test_paged_attention_merge_paths[120-256-1]"
                "$T::test_paged_attention_merge_paths[128-256-1]"
                "$T::test_paged_attention_two_slice_steps[120-40-2]"
                "$T::test_paged_attention_layouts[6-120-1]"
                "$T::test_paged_attention_wgmma[48-1-torch.bfloat16]"
                "$T::test_paged_attention_small_groups_long_tables[4-2-2100-torch.bfloat16]"
                "$T::test_paged_attention_small_groups_long_tables[24-1-2100-torch.float16]"
                "$T::test_paged_attention_small_grid_two_warpgroups"
                "$T::test_paged_attention_warpgroup_plans[64-4096-2-2-1-True]"
                "$T::test_paged_attention_cache_views[sequence_major-bfloat16-96-2]"
                "$T::test_paged_attention_strided_query"
                "$T::test_reshape_and_cache[120-torch.float16]"
                "$L::test_kernel_matches_float32[True-136-14336-9-bfloat16]"
                "$L::test_every_split_gives_the_product[5-8]"
                "$L::test_strided_rows_and_weight_slices"
                "$L::test_silu_and_mul_matches_float32[True-520-4096-9-bfloat16]"
                "$L::test_silu_and_mul_every_split[8]"
                "$L::test_qkv_rope_cache_matches_float32[True-8-2-128-9-bfloat16]"
                "$L::test_qkv_rope_cache_matches_float32[False-6-1-80-16-float16]"
                "$L::test_residual_norm_matches_float32[True-9-bfloat16]"
                "$L::test_rms_sums_scale_the_products[9-float16]")
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
for stage in $STAGES; do
  start=$(date +%s)
  case $stage in
    build)
      python3 -c "import torch; from tpkit.ops import _extension; _extension.build(torch.cuda.get_device_capability())" \
        > "$OUT/build.log" 2>&1 || { echo "BUILD FAILED"; tail -40 "$OUT/build.log"; exit 1; } ;;
    tests)
      timeout 400 python3 -m pytest -q -p no:cacheprovider --tb=short -W ignore::UserWarning $T $L \
        > "$OUT/tests.log" 2>&1; grep -E "passed|failed|error" "$OUT/tests.log" | tail -3
      grep -E "^FAILED|^ERROR" "$OUT/tests.log" | head -20 ;;
    sanitize)
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 240 compute-sanitizer --tool memcheck --leak-check no \
        python3 -m pytest -q -p no:cacheprovider --tb=short "${SANITIZE_CASES[@]}" > "$OUT/sanitizer.log" 2>&1
      echo "sanitizer rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitizer.log" | tail -3 ;;
    bench)
      timeout 420 python3 benchmarks/bench_paged_attention.py --json "$OUT/paged_attention_h200.json" "$@" \
        > "$OUT/bench.log" 2>&1; echo "bench rc=$?"; sed -n '/^copy bandwidth/,$p' "$OUT/bench.log"
      grep "skipped\|plan" "$OUT/bench.log" | grep -v "sdpa-math\|sdpa-efficient" | head -20 ;;
  esac
  echo "[$stage: $(( $(date +%s) - start )) s]"
done
