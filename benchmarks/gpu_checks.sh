#!/usr/bin/env bash
# Every GPU check of issue #24 in one run, for a lent GPU machine (the device tool runs it
# in the repository root; results land in $OUT). Runs from the source tree, no install:
# wheels the machine lacks travel in .whl (git-ignored) and go to /tmp/site. On 2026-11-27
# the H100 image (Python 3.12, torch 2.11) lacked pydantic, pydantic-core, annotated-types,
# typing-inspection and platformdirs, and had transformers 5.17 (5.24 carried):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl transformers==5.24.0 pydantic==2.14.4 \
#     pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 platformdirs==4.14.8
#   BENCH_S / TESTS_S: time limits of the two stages (seconds); MODEL, REQUESTS, SEQS,
#   MIN_OUTPUT, MAX_OUTPUT, RUNS, DEVICE shrink it for a CPU rehearsal (NO_WHEELS=1 there).
# The benchmark goes first (the figures the bars need); its JSON is rewritten after
# every run, so a stage cut by its limit keeps what it measured.
set -u
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
if [ -z "${NO_WHEELS:-}" ] && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src:$PWD:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1 MOEFLEET_CACHE_DIR=/tmp/moefleet-cache HF_HUB_OFFLINE=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers',
transformers.__version__, torch.cuda.get_device_name(), 'grouped_mm', hasattr(torch, '_grouped_mm'))"
  nproc; } 2>&1 | tee "$OUT/env.txt"
RUNS=${RUNS:-engine_fused@paged,brownout_8_0.4@paged,brownout_8_0@paged,hf_static,engine_fused,hf_sequential,engine_stacked@paged,brownout_2_0@paged,brownout_4_0.2@paged}
(cd benchmarks && timeout "${BENCH_S:-300}" python3 engine_scale.py --device "${DEVICE:-cuda}" \
  --model "${MODEL:-olmoe-1b-7b}" --load-model '' --requests "${REQUESTS:-256}" \
  --max-num-seqs "${SEQS:-256}" --min-prompt 64 --max-prompt 512 --min-output "${MIN_OUTPUT:-64}" \
  --max-output "${MAX_OUTPUT:-256}" --max-model-len 1024 --rounds 1 --profile --runs "$RUNS" \
  --out "$OUT/engine_scale_cuda.json") > "$OUT/bench.log" 2>&1
echo "benchmark rc=$?" | tee -a "$OUT/bench.log"
grep -E "^round|requests|Error|error" "$OUT/bench.log" | tail -30
timeout "${TESTS_S:-120}" python3 -m pytest -q -p no:cacheprovider -o addopts="" ${TESTS:-tests/gpu} \
  > "$OUT/tests.log" 2>&1
echo "tests rc=$?" | tee -a "$OUT/tests.log"
grep -E "passed|failed|FAILED|Error" "$OUT/tests.log" | tail -30
