"""Lay out the book's source for a build that executes nothing (`scripts/book.sh --executed DIR`).

    python scripts/stage_book.py EXECUTED STAGE

EXECUTED holds the notebooks already executed, with their outputs, at the paths the table of
contents uses (notebooks/00_engine.ipynb for `file: notebooks/00_engine`), as the nbval stage of
scripts/test.sh writes them (scripts/nbval_save.py). STAGE is made afresh with:
- each page of book/_toc.yml: the executed .ipynb for a notebook page, the source for a text page
  (.md, .rst); a notebook page that was not executed is an error, since it would show no outputs;
- book/_toc.yml itself, and _static/ (copied);
- data/ and figures/ (links), for prose that points at a committed file;
- a _config.yml made from the repo's, with execution off and `*.ipynb` no longer excluded.
The pages keep their paths, so the built book has the same URLs as one built from the repo root.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
TOC = Path("book") / "_toc.yml"
NOTEBOOK = {".py", ".ipynb"}
TEXT = {".md", ".rst"}
LINKED = ("data", "figures")


def toc_pages(toc: dict) -> list[str]:
    """Every page of a Jupyter Book table of contents (root, chapters, sections, at any depth)."""
    pages = [toc["root"]] if "root" in toc else []

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("file"), str):
                pages.append(node["file"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk({k: v for k, v in toc.items() if k != "root"})
    return pages


def _page_stem(page: str) -> str:
    """A toc entry may carry its suffix (notebooks/x.py) or not (notebooks/x)."""
    path = Path(page)
    return str(path.with_suffix("")) if path.suffix in NOTEBOOK | TEXT else page


def stage(executed: Path, target: Path) -> list[str]:
    """Lay out target; returns the notebook pages with no executed copy (empty when all is well)."""
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    missing = []
    for page in map(_page_stem, toc_pages(yaml.safe_load((ROOT / TOC).read_text()))):
        ran = executed / f"{page}.ipynb"
        if ran.is_file():
            _copy(ran, target / f"{page}.ipynb")
            continue
        sources = [p for p in sorted(ROOT.glob(f"{page}.*")) if p.suffix in NOTEBOOK | TEXT]
        text = [p for p in sources if p.suffix in TEXT]
        if text:
            _copy(text[0], target / f"{page}{text[0].suffix}")
        else:
            missing.append(page)
    _copy(ROOT / TOC, target / TOC)
    if (ROOT / "_static").is_dir():
        shutil.copytree(ROOT / "_static", target / "_static")
    for name in LINKED:
        if (ROOT / name).is_dir():
            (target / name).symlink_to(ROOT / name, target_is_directory=True)

    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    config.setdefault("execute", {})["execute_notebooks"] = "off"
    config["exclude_patterns"] = [p for p in config.get("exclude_patterns", []) if not p.endswith(".ipynb")]
    (target / "_config.yml").write_text(
        "# Made by scripts/stage_book.py from the repo's _config.yml: the notebooks here are already\n"
        "# executed, so the build runs none of them.\n" + yaml.safe_dump(config, sort_keys=False))
    return missing


def _copy(source: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source, dest)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    executed, target = (Path(a).resolve() for a in argv)
    missing = stage(executed, target)
    for page in missing:
        print(f"book: {page} has no executed notebook in {executed} (did its nbval run start?)", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
