#!/usr/bin/env bash
# Every GPU check in one device call (the device tool allows 10 min per command and ~15 min per session): each script
# under its own time limit, so one hang cannot eat the rest. JSON and logs go to $OUT (else ./gpu_out); the exit
# status is the number of scripts that failed.
#     bash tests/gpu_all.sh
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"    # the GPU machine runs the working tree; nothing is installed
export OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia-smi.csv" 2>&1
"$PY" -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)" > "$OUT/versions.txt" 2>&1
failed=0
for check in "gpu_ops.py" "gpu_offload.py" "gpu_fsdp.py $OUT/gpu_fsdp.json" "gpu_compile.py $OUT/gpu_compile.json" \
             "gpu_reserved.py $OUT/gpu_reserved.json"; do
  name="${check%% *}"
  start=$(date +%s)
  timeout "${GPU_CHECK_TIMEOUT:-190}" "$PY" tests/$check > "$OUT/${name%.py}.log" 2>&1
  rc=$?
  echo "== $name: exit $rc after $(( $(date +%s) - start )) s"
  tail -n 4 "$OUT/${name%.py}.log"
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
done
# capture on CUDA (fake vs real op for op, peaks vs MemTracker); the GPU machine has no transformers: skip the HF cases
start=$(date +%s)
timeout "${GPU_CHECK_TIMEOUT:-190}" "$PY" -m pytest -q -p no:cacheprovider -m gpu -k "not hf" tests/test_capture.py > "$OUT/gpu_capture.log" 2>&1
rc=$?
echo "== gpu capture tests: exit $rc after $(( $(date +%s) - start )) s"; tail -n 2 "$OUT/gpu_capture.log"
[ "$rc" -eq 0 ] || failed=$((failed + 1))
exit "$failed"
