#!/usr/bin/env bash
# The GPU checks and benchmarks, in stages, from the repository root of a machine with one or more GPUs.
#
#   bash benchmarks/run_gpu.sh                      # every stage the visible GPUs allow
#   bash benchmarks/run_gpu.sh build tests latency  # the stages named, in that order
#
# Single GPU:  build       JIT-build the CUDA extension (python -m tpkit.ops.build does it ahead of time)
#              tests       the whole test suite on the GPU (the CPU multi-rank tests included)
#              sanitize    compute-sanitizer memcheck of a few kernel cases
#              demo        python -m tpkit.demo, eager and with CUDA graphs
#              attention   bench_paged_attention.py (and on float8 caches), bench_attention_variants.py
#              decode-gemm bench_decode_gemm.py
#              prefill     bench_paged_prefill.py (several query tokens a sequence)
#              latency     bench_latency.py              profile      profile_generate.py
#              cross-qkv   bench_cross_qkv.py --device cuda
# Several GPUs: torchrun-tests  the suite under torchrun (NCCL), then the test that starts its own NCCL ranks
#              examples    the examples under torchrun     tp-scaling  bench_tp_scaling.py --cuda-graph
#              parity      check_tp_parity.py               loader      bench_loader.py --device cuda
#              allreduce   bench_allreduce.py
#
# Each stage's output goes to the terminal and to $LOGS/<stage>.log (default benchmarks/logs); the
# benchmarks write their JSON rows to benchmarks/results/. A stage's failure is reported and the next
# one runs; the script exits non-zero when any stage failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TPKIT_DISABLE_PROGRESS=1
LOGS=${LOGS:-benchmarks/logs}
mkdir -p "$LOGS"
NPROC=${NPROC:-$(nvidia-smi --list-gpus | wc -l)}
TP_SIZES=$(python3 -c "print(','.join(str(t) for t in (1, 2, 4, 8) if t <= $NPROC))")
SINGLE=(build tests sanitize demo attention prefill decode-gemm latency profile cross-qkv)
MULTI=(torchrun-tests examples tp-scaling parity loader allreduce)
PYTEST=(-m pytest -q -p no:cacheprovider --tb=short -rfE)

T=tests/test_paged_attention_cuda.py
L=tests/test_decode_linear_cuda.py
# Small, varied cases: head 120 (k-step padding), MQA 48:1 + ALiBi, fp32, head 256, many sequences (no
# split), the cluster merge (mma and warpgroup kernels), two-slice steps, swizzled rows with pad chunks,
# the warpgroup kernel (two warpgroups a block, in a small grid and for C6; small groups on long tables), a
# strided cache, a strided query, cache writes, and the decode linear kernel's epilogues.
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

run_stage() {
  case $1 in
    build) python3 -c "import torch; from tpkit.ops import _extension
_extension.build(torch.cuda.get_device_capability())" ;;
    tests) python3 "${PYTEST[@]}" tests ;;
    sanitize) PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --leak-check no \
                python3 "${PYTEST[@]}" "${SANITIZE_CASES[@]}" ;;
    demo) python3 -m tpkit.demo && python3 -m tpkit.demo --cuda-graph ;;
    attention) python3 benchmarks/bench_paged_attention.py &&
               python3 benchmarks/bench_paged_attention.py --flex-budget-s 0 --kv-dtype fp8_e4m3 \
                 --json benchmarks/results/paged_attention_fp8_h200.json &&
               python3 benchmarks/bench_attention_variants.py ;;
    prefill) python3 benchmarks/bench_paged_prefill.py ;;
    decode-gemm) python3 benchmarks/bench_decode_gemm.py --json benchmarks/results/decode_gemm_gpu.json ;;
    latency) python3 benchmarks/bench_latency.py ;;
    profile) python3 benchmarks/profile_generate.py --top 40 ;;
    cross-qkv) python3 benchmarks/bench_cross_qkv.py --device cuda ;;
    torchrun-tests) torchrun --nproc-per-node "$NPROC" "${PYTEST[@]}" tests --ignore "$T" &&
                    python3 "${PYTEST[@]}" tests/test_generate.py -k two_ranks ;;
    examples) torchrun --nproc-per-node "$NPROC" examples/custom_model.py &&
              torchrun --nproc-per-node "$NPROC" examples/train_tp.py &&
              torchrun --nproc-per-node "$NPROC" examples/train_tp.py --sequence-parallel ;;
    tp-scaling) python3 benchmarks/bench_tp_scaling.py --device cuda --shapes 8b --tp-sizes "$TP_SIZES" \
                  --cuda-graph --repeats 2 ;;
    parity) python3 benchmarks/check_tp_parity.py --device cuda --shapes 8b --tp-sizes "$TP_SIZES" ;;
    loader) python3 benchmarks/bench_loader.py --device cuda --tp-sizes "$TP_SIZES" ;;
    allreduce) torchrun --nproc-per-node 2 benchmarks/bench_allreduce.py ;;
    *) echo "unknown stage '$1'; stages: ${SINGLE[*]} ${MULTI[*]}" >&2; return 2 ;;
  esac
}

if [ $# -gt 0 ]; then
  STAGES=("$@")
elif [ "$NPROC" -gt 1 ]; then
  STAGES=("${SINGLE[@]}" "${MULTI[@]}")
else
  STAGES=("${SINGLE[@]}")
fi

{ nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  date -u; } | tee "$LOGS/machine.txt"
failed=()
for stage in "${STAGES[@]}"; do
  echo "=== $stage"
  start=$(date +%s)
  run_stage "$stage" 2>&1 | tee "$LOGS/$stage.log"
  status=${PIPESTATUS[0]}
  echo "=== $stage: exit $status in $(( $(date +%s) - start )) s"
  [ "$status" -eq 0 ] || failed+=("$stage")
done
[ ${#failed[@]} -eq 0 ] || { echo "failed stages: ${failed[*]}"; exit 1; }
