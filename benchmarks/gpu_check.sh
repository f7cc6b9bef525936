#!/usr/bin/env bash
# The one prepared GPU check (issue 7: CUDA speed), run from the repo root on the device
# machine; at most about 8.5 minutes (TOTAL_BUDGET: the suite gets what the tests left):
#   1. the Python environment (versions, CUDA), 2. the GPU tests (`pytest -m gpu`),
#   3. benchmarks/gpu_suite.py on the Llama 3.2 1B and 3.1 8B shapes, 4. the host's time
#   per decode step on this machine's CPU (benchmarks/host_overhead.py, null model).
# Logs and the suite's JSON go to $OUT (default ./gpu-results). Packages missing there
# (gguf) travel as wheels in .whl/ (carry it): they are installed into /tmp/site first.
# Before the device call, here:
#   pip download --no-deps gguf==0.19.0 -d .whl && echo /.whl/ >> .git/info/exclude
# then: run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=600)
set -u -o pipefail
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
TOTAL_BUDGET=${TOTAL_BUDGET:-510}  # seconds for the whole script (the run call allows 600)
TESTS_TIMEOUT=${TESTS_TIMEOUT:-200}  # ~100 cold Triton compiles on a fresh machine
SUITE_TIMEOUT=${SUITE_TIMEOUT:-300}
SUITE_BUDGET=${SUITE_BUDGET:-240}
HOST_TIMEOUT=${HOST_TIMEOUT:-30}
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}

echo "== environment" | tee "$OUT/env.txt"
$PY - <<'EOF' 2>&1 | tee -a "$OUT/env.txt"
import importlib
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
for name in ("transformers", "triton", "tokenizers", "safetensors", "gguf", "numpy", "pytest"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:
        print(name, "MISSING:", type(e).__name__, e)
try:
    import tokenmill.engine.engine  # noqa: F401
    print("tokenmill imports")
except Exception as e:
    print("tokenmill import FAILED:", type(e).__name__, e)
EOF
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv 2>&1 | tee -a "$OUT/env.txt"

echo "== gpu tests (timeout ${TESTS_TIMEOUT}s)"
# Only the folders that hold GPU tests: the others import packages the device image lacks
# (fastapi, llguidance, openai...), and one failed import would stop the whole collection.
# -v: one line per test as it ends, so a timeout still leaves which passed, failed or hung;
# the timeout interrupts first (SIGINT: pytest then prints its summary and durations),
# and kills 10 s later.
timeout -s INT -k 10 "$TESTS_TIMEOUT" $PY -m pytest -m gpu -v --tb=short --durations=15 \
  -p no:cacheprovider -rfEs tests/attention tests/worker tests/layer_kernels 2>&1 \
  | tee "$OUT/gpu_tests.txt"
echo "gpu tests exit code: $? (after ${SECONDS}s)" | tee -a "$OUT/gpu_tests.txt"

# What is left of TOTAL_BUDGET after the host step bounds the suite (it keeps 60 s past
# its budget for the stage running then).
LEFT=$((TOTAL_BUDGET - SECONDS - HOST_TIMEOUT))
if [ "$LEFT" -lt "$SUITE_TIMEOUT" ]; then
  SUITE_TIMEOUT=$((LEFT > 60 ? LEFT : 60))
  SUITE_BUDGET=$((SUITE_TIMEOUT - 60 > 30 ? SUITE_TIMEOUT - 60 : 30))
fi
echo "== gpu_suite (timeout ${SUITE_TIMEOUT}s, budget ${SUITE_BUDGET}s)"
timeout "$SUITE_TIMEOUT" $PY benchmarks/gpu_suite.py --shape 1b,8b --time-budget "$SUITE_BUDGET" \
  --out "$OUT/gpu_suite.json" 2>&1 | tee "$OUT/gpu_suite.txt"
echo "gpu_suite exit code: $? (after ${SECONDS}s)" | tee -a "$OUT/gpu_suite.txt"

echo "== host overhead (timeout ${HOST_TIMEOUT}s)"
timeout "$HOST_TIMEOUT" $PY benchmarks/host_overhead.py --vocab 512 --out-tokens 32 2>&1 \
  | tee "$OUT/host_overhead.txt"
