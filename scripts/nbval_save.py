"""A pytest plugin for the nbval stage of scripts/test.sh: it saves every notebook nbval runs, with
the outputs its cells produced, so that the book is built from them (scripts/book.sh --executed)
instead of executing every chapter a second time.

    PYTHONPATH=scripts python -m pytest --nbval-lax -p nbval_save \
        --nbval-save-root _build/nbval --nbval-save-to _build/executed _build/nbval/...

A notebook under the root is written to the same relative path under the target folder, after its
last cell has run (with pytest-xdist, in the worker that ran it). Each code cell gets the outputs it
produced, an error's traceback included, and an execution count; a cell that did not run (skipped,
or the run stopped before it) keeps no outputs. A notebook with a failing cell is still written:
the failure is nbval's to report, and its page shows the error."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest


def pytest_addoption(parser):
    group = parser.getgroup("nbval_save", "save the notebooks nbval executed")
    group.addoption("--nbval-save-to", metavar="DIR", default=None,
                    help="write each executed notebook, with its outputs, under DIR")
    group.addoption("--nbval-save-root", metavar="DIR", default=".",
                    help="notebooks keep their path relative to DIR under --nbval-save-to (default: .)")


def pytest_configure(config):
    if config.getoption("nbval_save_to"):
        config.pluginmanager.register(_Saver(config), "nbval_save_saver")


class _Saver:
    def __init__(self, config):
        self.root = Path(config.getoption("nbval_save_root")).resolve()
        self.target = Path(config.getoption("nbval_save_to")).resolve()
        self.pending: dict[int, pytest.File] = {}  # notebooks with a cell run and not yet written
        self.counts: dict[int, int] = {}

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        try:
            return (yield)
        finally:
            notebook = item.parent
            if hasattr(item, "test_outputs") and hasattr(notebook, "nb"):  # an nbval cell
                self._record(item, notebook)
                if nextitem is None or nextitem.parent is not notebook:
                    self._write(notebook)

    def pytest_sessionfinish(self, session):
        for notebook in list(self.pending.values()):  # a run cut short still leaves what it ran
            self._write(notebook)

    def _record(self, item, notebook):
        self.pending[id(notebook)] = notebook
        if item.test_outputs is None:  # skipped, or never sent to the kernel
            return
        count = self.counts.get(id(notebook), 0) + 1
        self.counts[id(notebook)] = count
        item.cell.execution_count = count  # item.cell is the cell in notebook.nb
        item.cell.outputs = [_output(out, count) for out in item.test_outputs]

    def _write(self, notebook):
        self.pending.pop(id(notebook), None)
        source = Path(str(notebook.fspath)).resolve()
        try:
            relative = source.relative_to(self.root)
        except ValueError:
            relative = Path(source.name)
        path = self.target / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(notebook.nb, str(path))


def _output(out, count):
    """nbval's record of one output as an nbformat output."""
    out = nbformat.from_dict(dict(out))
    if out.output_type == "execute_result":
        out.setdefault("execution_count", count)
    if out.output_type in ("display_data", "execute_result"):
        out.setdefault("metadata", {})
    return out
