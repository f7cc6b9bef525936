#!/usr/bin/env bash
# The one prepared GPU check (issue 7: CUDA speed), run from the repo root on the device
# machine; about 9 minutes at most:
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
TESTS_TIMEOUT=${TESTS_TIMEOUT:-150}
SUITE_TIMEOUT=${SUITE_TIMEOUT:-360}
SUITE_BUDGET=${SUITE_BUDGET:-280}
HOST_TIMEOUT=${HOST_TIMEOUT:-40}
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
timeout "$TESTS_TIMEOUT" $PY -m pytest -m gpu -q -p no:cacheprovider -rs \
  tests/attention tests/worker tests/layer_kernels 2>&1 | tee "$OUT/gpu_tests.txt"
echo "gpu tests exit code: $?" | tee -a "$OUT/gpu_tests.txt"

echo "== gpu_suite (timeout ${SUITE_TIMEOUT}s, budget ${SUITE_BUDGET}s)"
timeout "$SUITE_TIMEOUT" $PY benchmarks/gpu_suite.py --shape 1b,8b --time-budget "$SUITE_BUDGET" \
  --out "$OUT/gpu_suite.json" 2>&1 | tee "$OUT/gpu_suite.txt"
echo "gpu_suite exit code: $?" | tee -a "$OUT/gpu_suite.txt"

echo "== host overhead (timeout ${HOST_TIMEOUT}s)"
timeout "$HOST_TIMEOUT" $PY benchmarks/host_overhead.py --vocab 512 --out-tokens 32 2>&1 \
  | tee "$OUT/host_overhead.txt"
