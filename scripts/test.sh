#!/usr/bin/env bash
# README command 2: lint, unit tests, every notebook executed once, top to bottom, under nbval (its
# asserts are the gates), then the book built from those executed notebooks and opened in headless
# Chromium (tests/test_book.py).
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
# Two pytest-xdist workers, a test file each at a time (--dist loadfile: a file's module fixtures
# build once), one intra-op thread each for the reason the notebooks below give. Most tests spend
# their time in one Python thread (compiling, Triton's interpreter, a server and its client), so
# two at once took 502 s where one after another took 700 to 869 s on the 2-core CI machine.
step "unit tests" env OMP_NUM_THREADS=1 python -m pytest -q -n 2 --dist loadfile tests/ \
    --ignore=tests/test_book.py "$@"

# Every notebook runs once, under nbval: its asserts are the gates. nbval collects only .ipynb, so
# the jupytext notebooks are converted into a scratch folder, keeping their paths (nanolab resolves
# data/ and figures/ from the package, so the notebooks' cwd does not matter). scripts/nbval_save.py
# writes each notebook as it ran, outputs included, to _build/executed; the book is built from those
# without executing anything again. A notebook that fails fails this step; the book is still built
# from what ran, and its page shows the error, which the browser test reports too.
nbdir=_build/nbval
executed=_build/executed
rm -rf "$nbdir" "$executed" _build/html   # no book from an earlier run is left to be tested
shopt -s nullglob
ipynbs=()
for nb in notebooks/*.py book/*.py; do
    ipynbs+=("$nbdir/${nb%.py}.ipynb")
    mkdir -p "$(dirname "${ipynbs[-1]}")"
    jupytext --quiet --to ipynb --output "${ipynbs[-1]}" "$nb"
done
# Two pytest-xdist workers, one kernel each: a notebook's cells stay on one worker and in order
# (--dist loadscope), and a notebook mostly keeps one core busy, so two share the 2-core CI machine.
# Notebooks start in the order given (--no-loadscope-reorder), notebooks/ by name, so the engine's
# chapter, the longest, starts first instead of last.
# pytest is given the folders (each collects in name order), not every notebook by name.
if ((${#ipynbs[@]})); then
    mapfile -t folders < <(printf '%s\n' "${ipynbs[@]%/*}" | awk '!seen[$0]++')
    # One intra-op thread per kernel: two kernels of two OpenMP threads each on two cores spin against
    # each other, and a bench cell ran 5.8x slower that way (266 s against 46 s).
    step "notebooks" env OMP_NUM_THREADS=1 python -m pytest -q --nbval-lax --nbval-current-env -p no:cacheprovider \
        -n 2 --dist loadscope --no-loadscope-reorder \
        -p scripts.nbval_save --nbval-save-root "$nbdir" --nbval-save-to "$executed" "${folders[@]}"
fi

# The book, built from the notebooks executed above, then read in a browser: pages, images, search.
if [[ -d "$executed" ]]; then
    step "book" scripts/book.sh --executed "$executed"
else
    failed+=("book")
    echo "== book: not built, no notebook was executed" >&2
fi
step "browser" env NANOLAB_BOOK_BUILT=1 python -m pytest -q -rs -p no:cacheprovider tests/test_book.py

if ((${#failed[@]})); then
    echo "test: FAILED: ${failed[*]}" >&2
    exit 1
fi
echo "test: all green"
