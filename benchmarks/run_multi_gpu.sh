#!/usr/bin/env bash
# One call on a machine of several GPUs (nvidia-h200-x2 or -x4): the test suite and the examples under
# torchrun with NCCL, tp parity and scaling of the Llama-3-8B shapes, and loading into GPUs. Each stage has
# its own time limit; logs and JSON go to $OUT (at most 8 files come back from the device tool: one log a
# stage, two JSON).
#   bash benchmarks/run_multi_gpu.sh                         # every stage, over all visible GPUs
#   SKIP="parity loader" NPROC=2 bash benchmarks/run_multi_gpu.sh   # stages take up to 450 s: split calls
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_stages.sh
NPROC=${NPROC:-$(nvidia-smi --list-gpus | wc -l)}
TP_SIZES=$(python3 -c "print(','.join(str(t) for t in (1, 2, 4) if t <= $NPROC))")
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
nvidia-smi topo -m | head -$(( NPROC + 1 ))
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
date -u

stage build 150 python3 -c "import torch; from tpkit.ops import _extension
_extension.build(torch.cuda.get_device_capability())"
# The suite under torchrun, then the test that starts two NCCL ranks itself (skipped under torchrun):
# CUDA-graph decode at tp_size 2, then the teardown.
PYTEST="-m pytest -q -p no:cacheprovider --tb=short -rfE -W ignore::UserWarning"
stage tests 400 bash -c "torchrun --nproc-per-node $NPROC $PYTEST tests --ignore tests/test_paged_attention_cuda.py; \
  status=\$?; python3 $PYTEST tests/test_generate.py -k two_ranks || status=1; exit \$status"
# The examples over every GPU with NCCL: a custom model's logits and tokens, a training run beside transformers
# (and again with sequence parallelism: NCCL's reduce-scatter).
stage examples 180 bash -c "torchrun --nproc-per-node $NPROC examples/custom_model.py && \
  torchrun --nproc-per-node $NPROC examples/train_tp.py && \
  torchrun --nproc-per-node $NPROC examples/train_tp.py --sequence-parallel"
stage tp_scaling 300 python3 benchmarks/bench_tp_scaling.py --device cuda --shapes 8b --tp-sizes "$TP_SIZES" \
  --cuda-graph --repeats 2 --profile --out "$OUT"
stage parity 300 python3 benchmarks/check_tp_parity.py --device cuda --shapes 8b --tp-sizes "$TP_SIZES"
# Rounds of fresh processes (14-22 s each) at tp_size 1 and 2, as many as fit 400 s (3-4 on an H200 host).
stage loader 450 python3 benchmarks/bench_loader.py --device cuda --tp-sizes "$TP_SIZES" --rounds 6 --budget-s 400 \
  --json "$OUT/loader_cuda.json"

echo "=== tests"; grep -E "passed|failed|^FAILED|^ERROR" "$OUT/tests.log" | tail -8
echo "=== examples"; grep -E "^tp_size|steps:|Error" "$OUT/examples.log" | tail -4
echo "=== tp_scaling"; grep -A12 "^ tp batch" "$OUT/tp_scaling.log"
echo "=== parity"; tail -8 "$OUT/parity.log"
echo "=== loader"; sed -n '/^| goal/,$p' "$OUT/loader.log"
