from pathlib import Path

import pandas as pd
import pytest
import torch
from matplotlib.figure import Figure

from nanolab.lab import report


@pytest.fixture
def out_dirs(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "DATA_DIR", tmp_path / "data")
    monkeypatch.setattr(report, "FIGURES_DIR", tmp_path / "figures")
    return tmp_path


def _h200_label() -> report.RunLabel:
    cpu = report.run_label("cpu", "SmolLM2-135M", torch.bfloat16)
    return report.RunLabel(**{**cpu.as_columns(), "device": "NVIDIA H200", "device_slug": "h200"})


def test_paths_resolve_from_package_not_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert report.DATA_DIR == report.REPO_ROOT / "data"
    assert report.REPO_ROOT == Path(report.__file__).resolve().parents[2]
    assert (report.REPO_ROOT / "nanolab" / "__init__.py").exists()


def test_cpu_label():
    label = report.run_label("cpu", "SmolLM2-135M", torch.bfloat16, weights="synthesized random")
    assert label.device_slug == "cpu"
    assert label.dtype == "bfloat16"
    assert label.torch == torch.__version__
    assert "cores" in label.device
    assert label.date in label.caption() and "synthesized random" in label.caption()
    with pytest.raises(AssertionError):
        report.run_label("cpu", "SmolLM2-135M", torch.float32, weights="random")


def test_cuda_slug(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert report.device_slug("cuda:0") == "h200"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce RTX 4090")
    assert report.device_slug(torch.device("cuda", 0)) == "rtx-4090"


def test_save_table_names_the_device_and_labels_every_row(out_dirs):
    label = report.run_label("cpu", "SmolLM2-135M", "torch.float32")
    df = pd.DataFrame({"batch": [1, 2, 4], "ms_per_token": [50.0, 55.0, 61.0]})
    path = report.save_table(df, "decode", label)
    assert path == out_dirs / "data" / "decode_cpu.csv"
    back = pd.read_csv(path)
    assert list(back["batch"]) == [1, 2, 4]
    for column, value in label.as_columns().items():
        assert (back[column].astype(str) == value).all(), column
    assert "device" not in df.columns  # the caller's frame is left alone


def test_existing_columns_win(out_dirs):
    label = report.run_label("cpu", "SmolLM2-135M", torch.float32)
    df = pd.DataFrame({"dtype": ["float32", "bfloat16"], "ms": [1.0, 2.0]})
    back = pd.read_csv(report.save_table(df, "sweep", label))
    assert list(back["dtype"]) == ["float32", "bfloat16"]


def test_cpu_save_leaves_h200_result_alone(out_dirs):
    h200 = report.save_table(pd.DataFrame({"ms": [0.6]}), "decode", _h200_label())
    before = h200.read_bytes()
    cpu_label = report.run_label("cpu", "SmolLM2-135M", torch.bfloat16)
    report.save_table(pd.DataFrame({"ms": [50.0]}), "decode", cpu_label)
    report.save_table(pd.DataFrame({"ms": [9.0]}), "decode_batch", cpu_label)
    assert h200.read_bytes() == before

    tables = report.committed_tables("decode")
    assert set(tables) == {"cpu", "h200"}
    assert tables["h200"]["ms"].item() == 0.6
    assert tables["h200"]["device"].item() == "NVIDIA H200"
    assert report.load_table("decode", "cpu")["ms"].item() == 50.0
    assert report.load_table("decode", "a100") is None


def test_save_figure_writes_png_with_caption(out_dirs):
    label = report.run_label("cpu", "SmolLM2-135M", torch.float32)
    fig = Figure()
    fig.add_subplot().plot([1, 2, 4], [50, 55, 61])
    path = report.save_figure(fig, "decode", label)
    report.save_figure(fig, "decode", label)  # saving twice keeps one footer
    assert path == out_dirs / "figures" / "decode_cpu.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [t.get_text() for t in fig.texts] == [label.caption()]


def test_show_prints_without_ipython(monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def no_ipython(name, *args, **kwargs):
        if name.startswith("IPython"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ipython)
    report.show("hello")
    assert capsys.readouterr().out == "hello\n"


def test_chapter_target_on_the_cpu(monkeypatch):
    from nanolab.lab.report import chapter_target

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("NANOLAB_MODEL", raising=False)
    assert chapter_target("tiny") == (torch.device("cpu"), "tiny", torch.float32)
    monkeypatch.setenv("NANOLAB_MODEL", "/weights/llama")
    assert chapter_target("tiny")[1] == "/weights/llama"


def test_a_measured_table_comes_with_where_it_ran_and_a_missing_one_says_how_to_make_it(out_dirs, capsys):
    assert report.measured_table("day99_thing", "python -m nanolab thing") is None
    assert capsys.readouterr().out == ("data/day99_thing_h200.csv is not committed:\n"
                                       "  `python -m nanolab thing` on an H200 makes it\n")
    label = report.run_label(torch.device("cpu"), "tiny", torch.float32)
    report.save_table(pd.DataFrame({"x": [1]}), "day99_thing", label)
    table = report.measured_table("day99_thing", "unused", slug="cpu", where="a CPU")
    assert list(table.x) == [1]
    assert capsys.readouterr().out.startswith("measured on: " + label.caption().split(";")[0])
    assert report.measured_table("day99_other", "make it", slug="h200x2") is None
    assert "`make it` on the h200x2 machine makes it" in capsys.readouterr().out
