#!/usr/bin/env bash
# Decode/prefill speed of the jaxserve OPT on one NVIDIA GPU, in under 5 minutes (issue 13).
#
#   bash scripts/device_check.sh            # from the repo root on the GPU machine
#
# 1. Python with a CUDA jax: a fresh venv (.device-venv, git-ignored by .git/info/exclude) with
#    `pip install -U "jax[cuda12]==$JAX_VERSION"` and the project's few runtime needs. Where pip
#    cannot reach an index (an air-gapped machine), or with DEVICE_CHECK_PYTHON=/path/python,
#    an existing python whose jax already sees the GPU is used instead (its jax version is printed).
# 2. scripts/bench_model.py on the GPU: decode step at batch 1/8/16/32, context 512, jax
#    contiguous and paged, plus the bandwidth probe; transformers only where torch sees CUDA
#    (the torch column is then GPU torch), else `--no-torch`. fp32, then bf16.
# 3. The table is printed; the JSON samples go to $OUT (if set) or /tmp.
set -uo pipefail
cd "$(dirname "$0")/.."
JAX_VERSION="${JAX_VERSION:-0.10.2}"
OUT_DIR="${OUT:-/tmp}"
START=$(date +%s)

pick_python() {
  if [[ -n "${DEVICE_CHECK_PYTHON:-}" ]]; then echo "$DEVICE_CHECK_PYTHON"; return; fi
  if [[ ! -x .device-venv/bin/python ]]; then
    python3 -m venv .device-venv >/dev/null 2>&1 || true
    grep -qx '/.device-venv/' .git/info/exclude 2>/dev/null || echo '/.device-venv/' >> .git/info/exclude 2>/dev/null || true
  fi
  if [[ -x .device-venv/bin/python ]] && timeout 120 .device-venv/bin/python -m pip install -q -U \
      "jax[cuda12]==${JAX_VERSION}" "flax>=0.12" numpy ml_dtypes matplotlib >/dev/null 2>&1; then
    echo .device-venv/bin/python; return
  fi
  echo "pip could not install jax[cuda12]==${JAX_VERSION} (no index?): using the system python3" >&2
  echo python3
}

PY=$(pick_python)
echo "python: $PY"
"$PY" - <<'EOF' || { echo "no GPU visible to jax"; exit 1; }
import jax
print("jax", jax.__version__, "devices", jax.devices())
assert jax.devices()[0].platform == "gpu"
EOF
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv 2>/dev/null || true

TORCH_FLAG="--no-torch"
if "$PY" -c "import torch, transformers, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "torch sees CUDA: the transformers column runs on the GPU"
  TORCH_FLAG="--torch-device cuda"
fi

export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
for dtype in float32 bfloat16; do
  echo
  echo "=== bench_model.py --dtype $dtype ==="
  timeout 120 "$PY" scripts/bench_model.py --dtype "$dtype" --reps 10 --decode-steps 8 --plot '' \
    --max-load 64 $TORCH_FLAG --json "$OUT_DIR/bench_model_gpu_${dtype}.json" || echo "bench_model.py ($dtype) failed: $?"
done
echo
echo "device check done in $(( $(date +%s) - START )) s"
