#!/usr/bin/env bash
# The GPU part of the series, as one batch for a CUDA box whose image already has torch,
# transformers and pytest (the H200 image has no jupytext, so notebooks run as plain scripts;
# a percent-format notebook is valid Python). Results land in data/ and figures/ under the
# device's slug; with $OUT set (the device tool), they are also packed into $OUT/results.tgz.
#   scripts/gpu_run.sh [tests] [notebooks | notebooks/NAME.py ...] [bench] [capture] [stream] [tune]
#   (default: the first three)
# capture takes extra arguments from $CAPTURE_ARGS, e.g. CAPTURE_ARGS="--batches 1,8 --contexts 128".
# Results are packed after every part, so a run cut off by a time limit still returns what it made.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 MPLBACKEND=Agg
parts=("${@:-tests notebooks bench}")
parts=(${parts[*]})
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
for part in "${parts[@]}"; do
    echo "== $part ($(date -u +%T))"
    case $part in
        tests) python3 -m pytest -q -p no:cacheprovider tests/ -x || status=1 ;;
        notebooks) for nb in notebooks/*.py; do echo "-- $nb"; python3 "$nb" || status=1; done ;;
        notebooks/*.py) python3 "$part" || status=1 ;;
        capture) python3 -m nanolab capturebench --model llama-3.2-1b --dtype bfloat16 ${CAPTURE_ARGS:-} || status=1 ;;
        stream) python3 -m nanolab streambench || status=1 ;;
        tune) python3 -m nanolab streambench --tune || status=1 ;;
        bench) python3 -m nanolab bench --model llama-3.2-1b --dtype bfloat16 --batches 1,8,32 \
                   --prompt-len 128 --steps 64 --repeats 5 || status=1 ;;
        *) echo "unknown part $part" >&2; status=2 ;;
    esac
    if [[ -n "${OUT:-}" ]]; then
        tar czf "$OUT/results.tgz" data figures
    fi
done
exit $status
