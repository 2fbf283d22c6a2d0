#!/usr/bin/env bash
# README command 1: run every notebook (regenerating data/ and figures/) and build the HTML book.
#   scripts/book.sh                  executes every chapter as it builds (execute_notebooks: force)
#   scripts/book.sh --executed DIR   executes nothing: builds from notebooks already run, with their
#                                    outputs, at DIR/<toc path>.ipynb (scripts/test.sh's nbval stage
#                                    writes them to _build/executed), staged by scripts/stage_book.py
# Either way the pages land at the same URLs: _build/html/notebooks/<name>.html.
set -euo pipefail
executed=""
if [[ "${1:-}" == --executed ]]; then
    executed="$(cd "${2:?usage: scripts/book.sh [--executed DIR]}" && pwd)"
elif (($#)); then
    echo "usage: scripts/book.sh [--executed DIR]" >&2
    exit 2
fi
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"   # cds to the repo root, activates .venv

src=.
rm -rf _build/html/reports   # so a failure lists only this build's reports
if [[ -n "$executed" ]]; then
    src=_build/book-src
    rm -rf _build/html   # nothing of an earlier build survives, a page since removed included
    python scripts/stage_book.py "$executed" "$src"
fi

# Execution is forced by _config.yml (the staged copy turns it off); --all rereads every page so
# every notebook runs each build. A notebook error, or any Sphinx warning, fails the build only
# with -W; --keep-going finishes the build to report them all.
rc=0
jupyter-book build "$src" --toc "$REPO_ROOT/$src/book/_toc.yml" --path-output . --all -W --keep-going || rc=$?

if [[ $rc -ne 0 ]]; then
    echo "book: build FAILED (rc=$rc)" >&2
    if [[ -d _build/html/reports ]]; then
        find "$REPO_ROOT/_build/html/reports" -type f |
            sed 's/^/book: notebook error report: /' >&2
    fi
    exit "$rc"
fi
echo "book: built $REPO_ROOT/_build/html/index.html"
