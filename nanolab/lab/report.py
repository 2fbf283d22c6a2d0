"""Run labels and output paths: every table and figure says which machine, model and versions made it.

Introduced with the engine core (before Day 49).

Tables go to `data/<stem>_<device_slug>.csv` and figures to `figures/<stem>_<device_slug>.png`. The
device slug in the name is what keeps a CPU run from overwriting a committed H200 result, and lets a
notebook show both side by side (`committed_tables`).
"""

from __future__ import annotations

import io
import os
import platform
import re
import sys
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import NamedTuple

import pandas as pd
import torch

from nanolab.model.weights import resolve_weights, weights_kind

# Resolved from this file, never from the cwd: notebook cells run with notebooks/ (or a build folder) as cwd.
REPO_ROOT = Path(__file__).resolve().parents[2]
DATA_DIR = REPO_ROOT / "data"
FIGURES_DIR = REPO_ROOT / "figures"

WEIGHTS_KINDS = ("real", "synthesized random")
_CAPTION_GID = "nanolab-run-label"


def _slugify(name: str) -> str:
    # Slugs never contain "_": it separates the stem from the slug in file names.
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def device_slug(device: torch.device | str) -> str:
    """A short file-name-safe device name: "cpu", or e.g. "h200" for "NVIDIA H200"."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        name = re.sub(r"^(NVIDIA|AMD)\s+|GeForce\s+", "", name, flags=re.IGNORECASE)
        return _slugify(name)
    return device.type


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        model = ""
    model = model or platform.processor() or platform.machine() or "unknown CPU"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = torch.get_num_threads()  # what timings ran on: scripts/test.sh gives a notebook one
    if threads == cores:
        return f"{model} ({cores} cores)"
    return f"{model} ({cores} cores, {threads} thread{'s' * (threads > 1)})"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return _cpu_name()
    return device.type


def _version(*dists: str) -> str:
    for dist in dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "absent"


def _dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class RunLabel:
    """Where a number came from. `as_columns()` goes on every CSV row, `caption()` under every figure."""

    device: str  # human name: "NVIDIA H200", or "AMD EPYC 7B13 (2 cores)"
    device_slug: str  # file-name part: "h200", "cpu"
    model: str
    dtype: str  # "bfloat16"
    date: str  # ISO date, UTC
    torch: str
    triton: str  # version, or "absent"
    transformers: str  # version, or "absent"
    python: str
    weights: str  # "real" or "synthesized random"

    def caption(self) -> str:
        return (
            f"{self.model} ({self.weights} weights), {self.dtype} on {self.device}, {self.date}; "
            f"torch {self.torch}, triton {self.triton}, transformers {self.transformers}, "
            f"python {self.python}"
        )

    def as_columns(self) -> dict[str, str]:
        return asdict(self)


def run_label(
    device: torch.device | str, model: str, dtype: torch.dtype | str, weights: str = "real"
) -> RunLabel:
    """Label a run on `device` now; `weights` says whether the numbers came from a real checkpoint."""
    assert weights in WEIGHTS_KINDS, f"weights must be one of {WEIGHTS_KINDS}, got {weights!r}"
    device = torch.device(device)
    return RunLabel(
        device=_device_name(device),
        device_slug=device_slug(device),
        model=model,
        dtype=_dtype_name(dtype),
        date=datetime.now(UTC).date().isoformat(),
        torch=torch.__version__,
        triton=_version("triton", "pytorch-triton", "pytorch-triton-rocm"),
        transformers=_version("transformers"),
        python=platform.python_version(),
        weights=weights,
    )


def table_label(df: pd.DataFrame) -> RunLabel:
    """The label a saved table carries on its rows: where its numbers were measured. A table
    whose rows came from several runs (`--append`) names each distinct value of a field, in row
    order, so its caption says every date and version that produced it."""
    def values(name: str) -> str:
        return ", ".join(dict.fromkeys(df[name].astype(str)))

    return RunLabel(**{name: values(name) for name in RunLabel.__dataclass_fields__})


def chapter_target(cpu_model: str) -> tuple[torch.device, str, torch.dtype]:
    """Where a chapter runs: on a GPU, Llama-3.2-1B shapes in bf16; on the CPU, `cpu_model` in
    fp32 at a size CI can afford. `NANOLAB_MODEL` (a preset or a folder) overrides the model."""
    if torch.cuda.is_available():
        return torch.device("cuda"), os.environ.get("NANOLAB_MODEL", "llama-3.2-1b"), torch.bfloat16
    return torch.device("cpu"), os.environ.get("NANOLAB_MODEL", cpu_model), torch.float32


class ChapterRun(NamedTuple):
    device: torch.device
    model: str  # the preset or folder the chapter runs
    dtype: torch.dtype
    path: Path  # its weights folder
    label: RunLabel


def chapter_run(cpu_model: str) -> ChapterRun:
    """A chapter's setup: `chapter_target`'s device, model and dtype, the model's weights folder
    (prepared once), and the run label every table and figure of the chapter carries."""
    device, model, dtype = chapter_target(cpu_model)
    path = resolve_weights(model)
    return ChapterRun(device, model, dtype, path, run_label(device, model, dtype, weights=weights_kind(path)))


def _plain(stem: str) -> str:
    """`stem` as a file name in data/ or figures/: no folder in it (a bench's --prefix), nothing empty."""
    if not stem or "/" in stem or "\\" in stem or stem.startswith("."):
        raise ValueError(f"{stem!r}: a table's or figure's name is a plain file name (a --prefix holds no folder)")
    return stem


def table_path(stem: str, slug: str) -> Path:
    return DATA_DIR / f"{_plain(stem)}_{slug}.csv"


def figure_path(stem: str, slug: str) -> Path:
    return FIGURES_DIR / f"{_plain(stem)}_{slug}.png"


def save_table(df: pd.DataFrame, stem: str, label: RunLabel) -> Path:
    """Write `df` to data/<stem>_<slug>.csv with the label's columns on every row.

    A column the table already has (say `dtype` in a dtype sweep) is kept: the row knows better.
    """
    out = df.copy()
    for name, value in label.as_columns().items():
        if name not in out.columns:
            out[name] = value
    path = table_path(stem, label.device_slug)
    path.parent.mkdir(parents=True, exist_ok=True)
    out.to_csv(path, index=False)
    return path


def load_table(stem: str, slug: str) -> pd.DataFrame | None:
    """The table saved for `stem` on device `slug`, or None if there is none."""
    path = table_path(stem, slug)
    return pd.read_csv(path) if path.exists() else None


def measured_table(stem: str, command: str, slug: str = "h200", where: str | None = None) -> pd.DataFrame | None:
    """`load_table(stem, slug)` as a chapter shows it: with the caption of where it was measured,
    or, when data/ lacks it, None and which `command` makes it on `where` (default: an H200 for
    slug "h200", else the machine the slug names)."""
    table = load_table(stem, slug)
    if table is None:
        where = where or ("an H200" if slug == "h200" else f"the {slug} machine")
        print(f"data/{stem}_{slug}.csv is not committed:\n  `{command}` on {where} makes it")
    else:
        print("measured on:", table_label(table).caption().replace("; ", ";\n  "))
    return table


def committed_tables(stem: str) -> dict[str, pd.DataFrame]:
    """Every device's table for `stem` in data/, keyed by slug: the committed GPU runs and the local one."""
    tables = {}
    for path in sorted(DATA_DIR.glob(f"{stem}_*.csv")):
        slug = path.stem[len(stem) + 1 :]
        if "_" not in slug:  # "decode_batch_cpu.csv" belongs to stem "decode_batch", not "decode"
            tables[slug] = pd.read_csv(path)
    return tables


def caption_figure(fig, label: RunLabel):
    """Put `label.caption()` under `fig` (replacing an earlier one); returns fig."""
    for text in [t for t in fig.texts if t.get_gid() == _CAPTION_GID]:
        text.remove()
    # y=0 with va="top" hangs the footer just below the figure; bbox_inches="tight" grows the canvas to fit.
    fig.text(0.5, 0.0, label.caption(), ha="center", va="top", fontsize=7, color="0.35", gid=_CAPTION_GID)
    return fig


def save_figure(fig, stem: str, label: RunLabel) -> Path:
    """Put `label.caption()` under `fig` and write figures/<stem>_<slug>.png."""
    caption_figure(fig, label)
    path = figure_path(stem, label.device_slug)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def show(obj) -> None:
    """`display` in a notebook; `print` where IPython is absent (the GPU box runs notebooks as scripts).

    A matplotlib figure is shown as a PNG, drawn here: a `Figure` made without pyplot has no rich
    display of its own, and one made with pyplot is closed after, so the inline backend does not
    show it a second time."""
    try:
        from IPython.display import Image, display
    except ImportError:
        print(obj)
        return
    from matplotlib.figure import Figure

    if not isinstance(obj, Figure):
        display(obj)
        return
    png = io.BytesIO()
    obj.savefig(png, format="png", dpi=100, bbox_inches="tight")
    display(Image(data=png.getvalue()))
    if "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].close(obj)
