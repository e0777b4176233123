# Sourced by the run_*_gpu.sh scripts from the repository root: the environment of a device call (the
# JIT build's cache, no progress bars, NVLink multicast off: it can take a host's shared GPUs out of
# service) and `stage NAME LIMIT_S COMMAND...`, which runs one step under its own time limit, its output in
# $OUT/NAME.log, unless SKIP names it.
export PYTHONPATH=. PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/tpkit_extensions TPKIT_DISABLE_PROGRESS=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/tpkit_gpu_out}
mkdir -p "$OUT"
stage() {
  local name=$1 limit=$2 start
  shift 2
  case " ${SKIP:-} " in *" $name "*) echo "[$name: skipped]"; return;; esac
  start=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "[$name: rc=$? in $(( $(date +%s) - start )) s]"
}
