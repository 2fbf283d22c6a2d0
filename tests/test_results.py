"""The results page and the front page's figure (`lab.results`, `lab.plots.results`): built from the
committed tables, every value computed and labelled, and a missing table reported, not invented."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import yaml

from nanolab.lab import plots
from nanolab.lab.report import load_table
from nanolab.lab.results import CHAPTERS, HEADLINES, Headline, headline_table


def test_every_committed_headline_is_computed_and_labelled():
    table, missing = headline_table("h200")
    assert not missing, f"headlines whose committed table is missing or lacks the row: {missing}"
    assert len(table) == len(HEADLINES)
    assert set(table.chapter) <= set(CHAPTERS.values())
    for col in ("value", "device", "model", "dtype", "date", "source"):
        assert table[col].astype(str).str.len().min() > 0, f"an empty {col}"
    floor = load_table("day61_floor", "h200")
    ours = floor[(floor.arm == "nanolab") & (floor.batch == 1) & (floor.context == 128)].iloc[0]
    row = table[table.source.str.endswith("day61_floor_h200.csv")].iloc[0]
    assert row.value.startswith(f"{ours.ms_per_step:.3f} ms"), "the value is not the table's"


def test_the_chapters_are_the_books_notebooks_in_its_order():
    root = Path(__file__).resolve().parents[1]
    toc = yaml.safe_load((root / "book" / "_toc.yml").read_text())
    notebooks = [ch["file"].removeprefix("notebooks/") for part in toc["parts"] for ch in part["chapters"]
                 if ch["file"].startswith("notebooks/")]
    assert list(CHAPTERS) == notebooks
    assert all((root / "notebooks" / f"{name}.py").exists() for name in CHAPTERS)
    assert {h.chapter for h in HEADLINES} <= set(CHAPTERS)


def test_a_headline_reads_its_own_devices_table():
    """The CPU target's headline reads data/day61_floor_cpu.csv on a page of H200 results, and
    carries the CPU run's label."""
    cpu = tuple(h for h in HEADLINES if h.slug == "cpu")
    table, missing = headline_table("h200", cpu)
    assert cpu and not missing and (table.source == "data/day61_floor_cpu.csv").all()
    floor = load_table("day61_floor", "cpu")
    ours = floor[(floor.arm == "hf-default") & (floor.batch == 1)].iloc[0]
    assert table.iloc[0].value == f"{ours.nanolab_speedup:.2f}x" and table.iloc[0].device == ours.device


def test_a_missing_table_is_reported_not_shown():
    extra = Headline("61_the_floor", "day99_nothing", "a table nobody measured", lambda t: "x")
    table, missing = headline_table("h200", HEADLINES[:1] + (extra,))
    assert len(table) == 1 and missing == ["data/day99_nothing_h200.csv"]


def test_a_table_without_the_row_is_reported():
    wrong = Headline("61_the_floor", "day61_floor", "batch 3", lambda t: str(t[t.batch == 3].iloc[0].ms_per_step))
    table, missing = headline_table("h200", (wrong,))
    assert table.empty and missing and "day61_floor_h200.csv" in missing[0]


def test_the_headline_figure_draws_every_arm_and_the_floor():
    floor, roofline = load_table("day61_floor", "h200"), load_table("day61_roofline", "h200")
    fig = plots.plot_headline(floor, roofline)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert len(labels) == floor.arm.nunique() + 1 and any("floor" in t for t in labels)
    assert isinstance(floor, pd.DataFrame)


def test_a_headline_over_one_models_rows_takes_that_models_label():
    """day62_tp holds two models' rows: the 8B headline reads the 8B rows and names the 8B model,
    and a filter that matches nothing is reported."""
    table, _ = headline_table("h200", tuple(h for h in HEADLINES if h.stem == "day62_tp"))
    tp = load_table("day62_tp", "h200")
    ours = tp[(tp.model == "llama-3.1-8b") & (tp.arm == "tp1") & (tp.batch == 1)].iloc[0]
    assert table.iloc[0].value.startswith(f"{ours.ms_per_step:.3f} ms")
    assert table.iloc[0].model.startswith("llama-3.1-8b")
    nowhere = Headline("62_two_gpus", "day62_tp", "a model not run", lambda t: "x", where=(("model", "nope"),))
    table, missing = headline_table("h200", (nowhere,))
    assert table.empty and "no rows where" in missing[0]
