#!/usr/bin/env bash
# Throwaway call script: build, the GPU tests of this session's change, then bench_latency (run 17).
set -u
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"; date -u; } | tee "$OUT/gpu.txt"
export PYTHONPATH=$PWD
python3 -c "import torch; from tpkit.attention import _cuda; _cuda.build(torch.cuda.get_device_capability())" > "$OUT/build.log" 2>&1
echo "build done after $(( $(date +%s) - T0 )) s"
PYTEST="-m pytest -q -p no:cacheprovider --tb=short -rfE -W ignore::UserWarning"
timeout 170 python3 $PYTEST tests/test_elementwise_ops.py tests/test_decode_linear_cuda.py \
  tests/test_paged_attention_cuda.py::test_cuda_graph_replay > "$OUT/kernels.log" 2>&1 &
timeout 170 python3 $PYTEST tests/test_models_llama.py tests/test_generate.py > "$OUT/models.log" 2>&1 &
wait
echo "tests done after $(( $(date +%s) - T0 )) s"
for f in kernels models; do echo "== $f"; grep -E "passed|failed|^FAILED|^ERROR" "$OUT/$f.log" | tail -6; done
PYTHONPATH=.:benchmarks timeout 330 python3 benchmarks/bench_latency.py --out "$OUT" > "$OUT/latency.log" 2>&1
echo "latency done after $(( $(date +%s) - T0 )) s (rc $?)"; tail -40 "$OUT/latency.log"
