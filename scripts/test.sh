#!/usr/bin/env bash
# README command 2: lint, unit tests, every notebook executed top to bottom (its asserts are the gates),
# then the book built and opened in headless Chromium (tests/test_book.py).
# Extra arguments go to the unit-test pytest run, e.g. `scripts/test.sh -k weights`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"   # cds to the repo root, activates .venv

failed=()
step() {
    local name=$1
    shift
    echo "== $name"
    "$@" || failed+=("$name")
}

step "ruff" ruff check .
step "unit tests" python -m pytest -q tests/ --ignore=tests/test_book.py "$@"

# nbval collects only .ipynb: convert the jupytext notebooks into a scratch folder outside notebooks/
# (nanolab resolves data/ and figures/ from the package, so the notebooks' cwd does not matter).
nbdir=_build/nbval
rm -rf "$nbdir"
mkdir -p "$nbdir"
shopt -s nullglob
notebooks=(notebooks/*.py)
if ((${#notebooks[@]})); then
    for nb in "${notebooks[@]}"; do
        jupytext --quiet --to ipynb --output "$nbdir/$(basename "${nb%.py}").ipynb" "$nb"
    done
    step "notebooks" python -m pytest -q --nbval-lax --nbval-current-env -p no:cacheprovider "$nbdir"/*.ipynb
fi

# The book, built from scratch (every chapter rerun), then read in a browser: pages, images, search.
step "book" scripts/book.sh
step "browser" python -m pytest -q -rs -p no:cacheprovider tests/test_book.py

if ((${#failed[@]})); then
    echo "test: FAILED: ${failed[*]}" >&2
    exit 1
fi
echo "test: all green"
