#!/usr/bin/env bash
# GPU checks in one short run (under 8 minutes on one GPU), from the repo root:
#   bash bench/gpu_check.sh
# 1. the kernel tests, natively compiled (no interpreter);
# 2. bench/gpu_engine_check.py when present (engine greedy parity vs transformers, swap round trip);
# 3. the quick kernel benchmark -> bench/results/kernels_gpu.json.
# Installs nothing, except `pip install -e . --no-deps --no-build-isolation` when streamengine is
# not importable (GPU machines are often offline: the build uses the interpreter's setuptools).
# Uses $PYTHON if set, else .venv/bin/python when it exists, else python3.
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ -n "${PYTHON:-}" ]]; then
  PY="$PYTHON"
elif [[ -x .venv/bin/python ]]; then
  PY=.venv/bin/python
else
  PY=python3
fi

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: no CUDA device visible to $PY (torch.cuda.is_available() is False); nothing to check" >&2
  exit 2
fi
"$PY" -c "import torch, triton; print('gpu_check:', torch.cuda.get_device_name(0), 'torch', torch.__version__, 'triton', triton.__version__)"

if ! "$PY" -c "import streamengine.kernels" 2>/dev/null; then
  echo "gpu_check: streamengine not importable, installing it in editable mode (no dependencies)"
  "$PY" -m pip install -q -e . --no-deps --no-build-isolation || { echo "gpu_check: editable install failed" >&2; exit 1; }
fi

# Native kernels: TRITON_INTERPRET must not leak in from the caller's environment.
unset TRITON_INTERPRET
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p bench/results
status=0
step() {
  local name="$1" limit="$2"
  shift 2
  echo "=== gpu_check: $name"
  local t0=$SECONDS
  timeout "$limit" "$@"
  local rc=$?
  echo "=== gpu_check: $name -> exit $rc in $((SECONDS - t0)) s"
  if [[ $rc -ne 0 ]]; then status=1; fi
}

step "kernel tests" 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py
if [[ -f bench/gpu_engine_check.py ]]; then
  step "engine check" 120 "$PY" bench/gpu_engine_check.py
else
  echo "=== gpu_check: bench/gpu_engine_check.py not present, skipped"
fi
step "kernel benchmark" 90 "$PY" bench/attention_kernels.py --quick --json bench/results/kernels_gpu.json

if [[ $status -eq 0 ]]; then echo "gpu_check: all steps passed"; else echo "gpu_check: FAILED (see above)"; fi
exit $status
