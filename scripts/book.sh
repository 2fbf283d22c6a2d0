#!/usr/bin/env bash
# README command 1: run every notebook (regenerating data/ and figures/) and build the HTML book.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"   # cds to the repo root, activates .venv

# Execution is forced by _config.yml; --all rereads every page so every notebook runs each build.
# A notebook error fails the build only with -W; --keep-going finishes the build to report them all.
rm -rf _build/html/reports   # so a failure lists only this build's reports
rc=0
jupyter-book build . --toc book/_toc.yml --all -W --keep-going || rc=$?

if [[ $rc -ne 0 ]]; then
    echo "book: build FAILED (rc=$rc)" >&2
    if [[ -d _build/html/reports ]]; then
        find "$REPO_ROOT/_build/html/reports" -type f |
            sed 's/^/book: notebook error report: /' >&2
    fi
    exit "$rc"
fi
echo "book: built $REPO_ROOT/_build/html/index.html"
