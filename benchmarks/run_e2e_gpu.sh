#!/usr/bin/env bash
# One call on a one-GPU machine: build the paged-attention extension, then the end-to-end latency bench,
# the model/layer tests on the GPU (torchrun, NCCL, tp_size 1 cases), the cross-QKV bench and the
# single-GPU part of the tp-scaling bench. Each stage has its own time limit; logs and JSON go to $OUT.
#   bash benchmarks/run_e2e_gpu.sh
#   SKIP="cross_qkv tp_scaling" LATENCY_ARGS=--no-compile bash benchmarks/run_e2e_gpu.sh   # fewer stages
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_stages.sh
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'transformers', transformers.__version__)"; date -u; } | tee "$OUT/gpu.txt"

stage build 120 python3 -c "import torch; from tpkit.ops import _extension
_extension.build(torch.cuda.get_device_capability())"
stage tests 140 torchrun --nproc-per-node 1 -m pytest -q -p no:cacheprovider --tb=short -W ignore::UserWarning \
  tests/test_models_llama.py tests/test_models_gpt_bigcode.py tests/test_models_bart.py tests/test_generate.py \
  tests/test_linear.py tests/test_cross_qkv.py tests/test_attention_layer.py tests/test_loader_ranks.py \
  tests/test_loaders.py tests/test_linear_op.py
stage demo 90 sh -c "python3 -m tpkit.demo && python3 -m tpkit.demo --cuda-graph"
stage cross_qkv 50 python3 benchmarks/bench_cross_qkv.py --device cuda
stage tp_scaling 70 python3 benchmarks/bench_tp_scaling.py --device cuda --tp-sizes 1 --decode-steps 16 \
  --repeats 2 --out "$OUT"
stage latency "${LATENCY_LIMIT_S:-300}" python3 benchmarks/bench_latency.py ${LATENCY_ARGS:-} --out "$OUT"

echo "=== tests"; grep -E "passed|failed|^FAILED|^ERROR" "$OUT/tests.log" | tail -12
echo "=== demo"; grep -E "tokens/s|transformers check|rank|^ +[0-9]" "$OUT/demo.log" | head -12
echo "=== cross_qkv"; tail -14 "$OUT/cross_qkv.log"
echo "=== tp_scaling"; tail -6 "$OUT/tp_scaling.log"
echo "=== latency"; tail -45 "$OUT/latency.log"
