#!/usr/bin/env bash
# One GPU (H200), within 8 minutes: the CUDA-relevant checks and the GPT at ZeRO-3 with CPU
# offload, printing MFU. Installs nothing (the GPU machine reaches no network).
#
#   bash benchmarks/gpu_check.sh            # on the GPU machine, from the repository root
#   bash benchmarks/gpu_check.sh --dry-run  # anywhere: bash -n on this script, then the same
#                                           # checks on CPU with tiny models (gloo)
#
# Checks (benchmarks/gpu_check.py): NCCL at world size 1 (ZeRO-3 fp32 equals plain torch),
# bf16 (equals autocast within bf16 tolerance), pinned-memory CPU offload and NVMe offload of
# optimizer and parameters with the overlapped host step (equal to no offload), and the
# ~84 M GPT at ZeRO-3 + CPU offload, bf16: median step and MFU against 989 TFLOP/s (H200
# dense bf16), FLOPs from meshzero's flops profiler; offload_speed (gpu_offload_speed.py): a
# 1.28 B GPT (bf16, 8 x 1024) at ZeRO-2/3 with optimizer / both offloaded to pinned host memory,
# step time over the GPU-resident step, d2h / h2d GB/s, pinned vs pageable memcpy (fails on a
# pageable offload copy or d2h < 10 GB/s); profiler_truth (gpu_profiler_truth.py): a 1.24 B GPT
# at ZeRO-3, the profiler's headline against an outside timer and the profiled step against the
# median, both within 5 %; quantized (gpu_quantized.py): ZeRO++ qwZ + qgZ at ZeRO-3 equal a
# plain-torch replay with the same int8 weights and int4 gradients. (Besides
# tests/test_offload_cuda.py, skipped without CUDA, the test suite's distributed tests spawn
# gloo ranks on CPU: these are the CUDA tests.) Then compile (benchmarks/compile.py, issue 35):
# a 117 M GPT (8 x 1024, fp32) plain eager / plain compiled / meshzero eager / meshzero compiled
# at ZeRO-0 and 3 (inductor); fails if meshzero's compiled step is slower than its eager one
# (its own 180 s, after the budget above).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
cd "$root"
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"  # the host step uses every core
budget="${GPU_CHECK_SECONDS:-450}"   # the whole run, under 8 minutes
start=$(date +%s)
left() { echo $(( budget - ($(date +%s) - start) )); }

dry=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry=1 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $arg (use --dry-run or nothing)" >&2; exit 2 ;;
  esac
done

bash -n "$0"
echo "== gpu_check.sh: syntax ok; $(date -u +%FT%TZ) on $(hostname)"
python - <<'PY'
import torch
cuda = torch.cuda.is_available()
print(f"torch {torch.__version__}, cuda build {torch.version.cuda}, cuda available {cuda}")
if cuda:
    p = torch.cuda.get_device_properties(0)
    print(f"device {p.name}, {p.total_memory / 2**30:.0f} GiB, nccl {torch.cuda.nccl.version()}")
PY
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv || true

status=0
if [ "$dry" = 1 ]; then
  echo "== dry run: the checks on CPU with tiny models"
  timeout "$(left)" python benchmarks/gpu_check.py --device cpu --tiny --steps 2 || status=$?
else
  echo "== checks on the GPU"
  timeout "$(left)" python benchmarks/gpu_check.py --device cuda || status=$?
fi

# torch.compile under ZeRO: the dry run only checks that the four arms run (dynamo's eager
# backend, no C++ compile); on the GPU inductor and the rule
if [ "$dry" = 1 ]; then
  timeout 120 python benchmarks/compile.py --device cpu --tiny --backend eager --rule none \
    --warmup 1 --steps 1 || status=$?
else
  timeout 180 python benchmarks/compile.py --device cuda || status=$?
fi

echo "== gpu_check.sh: exit $status after $(( $(date +%s) - start )) s"
exit "$status"
