#!/usr/bin/env bash
# GPU checks in one short run (about 8 minutes at most on one H100; each step has its own
# timeout, so a hung step costs only its share), from the repo root:
#   bash bench/gpu_check.sh
# 1. the kernel tests, natively compiled (no interpreter);
# 2. bench/gpu_engine_check.py when present (engine greedy parity vs transformers, CUDA graphs of
#    decode steps against the same run eager, swap round trip, decoding paths);
# 3. bench/gpu_throughput.py: random-weight 1B and 7B Llamas, the engine eager / with graphs /
#    with an FP8 KV cache against transformers' generate_batch -> bench/results/gpu_throughput.json;
# 4. the quick kernel benchmark -> bench/results/kernels_gpu.json.
# Every step's JSON, and gpu_check.json (each step's exit status and seconds), are copied to
# $OUT when it is set (the device machine's folder that comes back).
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
started=$(mktemp)  # results older than this run are not copied to $OUT
status=0
steps=()
step() {
  local name="$1" limit="$2"
  shift 2
  echo "=== gpu_check: $name"
  local t0=$SECONDS
  timeout "$limit" "$@"
  local rc=$?
  echo "=== gpu_check: $name -> exit $rc in $((SECONDS - t0)) s$([[ $rc -eq 124 ]] && echo " (timed out at $limit s)")"
  steps+=("{\"step\": \"$name\", \"exit\": $rc, \"seconds\": $((SECONDS - t0)), \"limit_s\": $limit}")
  if [[ $rc -ne 0 ]]; then status=1; fi
}

step "kernel tests" 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py
if [[ -f bench/gpu_engine_check.py ]]; then
  step "engine check" 90 "$PY" bench/gpu_engine_check.py
else
  echo "=== gpu_check: bench/gpu_engine_check.py not present, skipped"
fi
# Writes its JSON after every system, so a timeout keeps what finished.
step "throughput" 225 "$PY" bench/gpu_throughput.py --json bench/results/gpu_throughput.json
step "kernel benchmark" 45 "$PY" bench/attention_kernels.py --quick --json bench/results/kernels_gpu.json

summary=$(IFS=,; echo "[${steps[*]}]")
echo "{\"device\": \"$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))')\", \"ok\": $([[ $status -eq 0 ]] && echo true || echo false), \"steps\": $summary}" \
  > bench/results/gpu_check.json
if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT"
  for f in gpu_check.json gpu_engine_check_cuda.json gpu_throughput.json kernels_gpu.json; do
    [[ "bench/results/$f" -nt "$started" ]] && cp "bench/results/$f" "$OUT/"
  done
  echo "gpu_check: JSON copied to $OUT"
fi
rm -f "$started"

if [[ $status -eq 0 ]]; then echo "gpu_check: all steps passed"; else echo "gpu_check: FAILED (see above)"; fi
exit $status
