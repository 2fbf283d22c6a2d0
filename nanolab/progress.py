"""`progress_bar`: tqdm's bar where someone is watching a terminal, and nothing elsewhere."""

from __future__ import annotations

from tqdm import tqdm


def progress_bar(iterable=None, *, enabled: bool = True, **kwargs) -> tqdm:
    """A tqdm bar over `iterable` (or `total=`) when `enabled` and the output is a terminal. In a
    notebook or a log a bar is only noise, and tqdm's notebook variant warns without ipywidgets, so
    there it stays silent (tqdm's `disable=None`)."""
    return tqdm(iterable, disable=None if enabled else True, **kwargs)
