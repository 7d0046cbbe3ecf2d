#!/bin/bash
# One GPU lease, one run: what this project still has to see on a GPU, in the order it matters.
#
# Prepare here (a machine with the package index), from the project root:
#     PYTHON=.venv/bin/python bash ../shared/tools/gpu-offline/prepare.sh     # .whl/ (wheels) and .gpu/ (fixtures)
# then one device run:  command `bash bench/gpu_session.sh`, carry [".whl", ".gpu"], timeout ~570 s.
# The GPU host has Python 3.12, torch with CUDA and transformers but no package index: the wheels install into
# two site folders (layerwise with the transformers it pins; llm-compressor 0.14 on the host's transformers).
#
# Stages, each under its own limit (seconds: BENCH_S, AR_S, TESTS_S, RECIPES_S); results in $OUT (or /tmp/gpu-out):
#   1. bench.txt   GPTQ W4A16 on a 1B-shaped bf16 Llama, 64 x 2048 tokens, layerwise then llm-compressor
#                  (bench/gpu_bench.py): the time ratio with and without layerwise's checkpoint read, every
#                  timed phase (the Hessians' dtype: bf16 inputs with fp32 sums on a GPU), the plan's GPU peak
#                  forecast against the peak allocated;
#   2. autoround.txt    AutoRound W3A16 g128 and W2A16 g64 on tiny-llama-doc (bf16) at the paper's 200 steps of 8,
#                       128 windows, layerwise on the GPU against llm-compressor's AutoRoundModifier (the
#                       auto-round package; its pipeline puts each block on the GPU): time and quality;
#   3. cuda-tests.txt   tests/runtime/test_devices.py with the GPU visible (the bf16 Gram test among them);
#   4. recipes.txt      every algorithm family on tiny-llama-doc (bf16) on the GPU (bench/gpu_recipes.py, the
#                       CPU's runs with CPU=1): perplexity and time of each.
set -u
OUTD=${OUT:-/tmp/gpu-out}; mkdir -p "$OUTD"
START=$(date +%s); stage() { echo "[+$(( $(date +%s) - START ))s] $*"; }
PY=${PY:-python3}; ROOT=$PWD; SITE=${SITE:-/tmp/gpu-site}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$OUTD/device.txt"
install() { $PY -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target "$SITE/$1" \
              .whl/"$1"/*.whl .whl/common/*.whl >/dev/null 2>&1 || echo "the $1 wheels did not install"; }
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
if [[ -z ${SMOKE:-} ]]; then  # SMOKE=1: a smoke test of this script on a CPU machine, in the current venv
  install lw; install lc
  export PYTHONPATH=$SITE/lw LAYERWISE_FIXTURES=$ROOT/.gpu/fixtures
  printf '#!/bin/bash\nPYTHONPATH=%s/lc exec %s "$@"\n' "$SITE" "$(command -v "$PY")" > /tmp/llmc-python
  chmod +x /tmp/llmc-python
  export LLMCOMPRESSOR_PYTHON=/tmp/llmc-python
fi
$PY -c "import sys, torch, transformers, layerwise; print(sys.version.split()[0], 'torch', torch.__version__,
'transformers', transformers.__version__, 'layerwise', layerwise.__version__)" 2>&1 | tail -1 | tee -a "$OUTD/device.txt"

stage "GPTQ bench, ${SHAPE:-1b}"
timeout "${BENCH_S:-180}" $PY bench/gpu_bench.py --shape "${SHAPE:-1b}" --samples "${SAMPLES:-64}" \
    --seq-len "${SEQ:-2048}" --device "${DEVICE:-cuda}" --llmcompressor --time-limit "${TOOL_S:-140}" 2>&1 | tee "$OUTD/bench.txt"
stage "AutoRound against llm-compressor's"
timeout "${AR_S:-180}" $PY bench/autoround_bench.py --device "${DEVICE:-cuda}" --methods AutoRound --llmcompressor --schemes "${AR_SCHEMES:-W3A16 g128,W2A16 g64}" \
    --iters 200 --batch-size 8 --samples 128 --eval 32 2>&1 | tee "$OUTD/autoround.txt"
stage "CUDA tests"
timeout "${TESTS_S:-90}" $PY -m pytest -q -p no:cacheprovider -rfE --disable-warnings tests/runtime/test_devices.py 2>&1 \
    | tail -25 | tee "$OUTD/cuda-tests.txt"
stage "every family on the GPU"
timeout "${RECIPES_S:-90}" $PY bench/gpu_recipes.py "${DEVICE:-cuda}" "${RECIPE_SAMPLES:-16}" --iters 20 \
    $([[ -n ${CPU:-} ]] || echo --no-cpu) 2>&1 \
    | grep -E "^(RECIPE|FREE|WARN)|Error" | tee "$OUTD/recipes.txt"
stage done
