"""The built book, opened in headless Chromium as a new reader would (Debian's `chromium`, driven by
Playwright). Every page of the table of contents loads with all its images, shows no traceback or
warning, and keeps its code and output inside the column; the search page finds "DecodePlan".
Screenshots of the front page and one chapter go to _build/screenshots/.

`scripts/test.sh` builds the book just before this test, from the notebooks its nbval stage executed
(`scripts/book.sh --executed`), and sets NANOLAB_BOOK_BUILT=1: the book is then used as it is. Run
alone, the test reuses _build/html when it is newer than every chapter and page source, and builds
it otherwise (`scripts/book.sh`, which runs every notebook). Without chromium or Playwright the tests
skip and say why."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
HTML = ROOT / "_build" / "html"
SHOTS = ROOT / "_build" / "screenshots"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Python's warning categories and tqdm's notebook complaint, as they print.
WARNING = re.compile(r"\b[A-Za-z]*Warning\b:|\bwarnings\.warn\b|IProgress not found")
TRACEBACK = re.compile(r"Traceback \(most recent call last\)")

try:
    from playwright.sync_api import sync_playwright
except ImportError:
    sync_playwright = None

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (scripts/setup.sh installs it "
                                                "where it runs as root with apt)"),
    pytest.mark.skipif(sync_playwright is None, reason="playwright is not installed (requirements.txt)"),
]


def toc_pages() -> list[str]:
    """The book's pages in order (root, chapters and their sections at any depth), as paths relative
    to the source root without a suffix."""
    toc = yaml.safe_load((ROOT / "book" / "_toc.yml").read_text())
    pages = [toc["root"]]

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("file"), str):
                pages.append(node["file"])
            for key, value in node.items():
                if key != "root":
                    walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(toc)
    return [re.sub(r"\.(py|ipynb|md|rst)$", "", page) for page in pages]


def sources() -> list[Path]:
    pages = [next(ROOT.glob(f"{page}.*")) for page in toc_pages()]
    return pages + [ROOT / "book" / "_toc.yml", ROOT / "_config.yml", *sorted((ROOT / "_static").glob("*"))]


@pytest.fixture(scope="module")
def book() -> Path:
    index = HTML / "searchindex.js"  # rewritten by every build (index.html, a redirect, is not)
    if os.environ.get("NANOLAB_BOOK_BUILT"):
        assert index.exists(), f"no book at {HTML.relative_to(ROOT)}: its build failed (see the book step)"
    elif not index.exists() or index.stat().st_mtime < max(p.stat().st_mtime for p in sources()):
        subprocess.run([str(ROOT / "scripts" / "book.sh")], check=True, cwd=ROOT)
    return HTML


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield chromium
        chromium.close()


def open_page(browser, url: str, width: int = 1280):
    page = browser.new_page(viewport={"width": width, "height": 1000})
    page.goto(url, wait_until="load")
    return page


@pytest.mark.parametrize("source", toc_pages())
def test_every_page_loads_clean(book, browser, source):
    path = book / f"{source}.html"
    assert path.exists(), f"{source}: no page at {path.relative_to(ROOT)}"
    page = open_page(browser, path.as_uri())
    try:
        main = page.locator("main")
        assert main.count() == 1 and main.inner_text().strip(), f"{source}: the page has no content"
        images = page.evaluate("""() => Array.from(document.querySelectorAll('main img'))
                                        .map(i => [i.getAttribute('src'), i.complete && i.naturalWidth > 0])""")
        broken = [src for src, ok in images if not ok]
        assert not broken, f"{source}: images that did not load: {broken}"
        text = main.inner_text()
        assert "<Figure size" not in text, f"{source}: a figure shows as text instead of an image"
        assert not TRACEBACK.search(text), f"{source}: a traceback shows near {_around(text, TRACEBACK)!r}"
        errors = page.locator("main div.output.traceback, main div.output.error").count()
        assert not errors, f"{source}: {errors} error outputs show"
        assert not WARNING.search(text), f"{source}: a warning shows near {_around(text, WARNING)!r}"
        stderr = page.locator("main div.output.stderr").all_inner_texts()
        assert not stderr, f"{source}: stderr output shows: {stderr[0][:300]!r}"
        overflowing = page.evaluate("""() => Array.from(document.querySelectorAll('main pre'))
            .filter(p => p.scrollWidth > p.clientWidth + 2).map(p => p.innerText.split('\\n')[0].slice(0, 80))""")
        assert not overflowing, f"{source}: code or output runs past the column: {overflowing[:3]}"
    finally:
        page.close()


def test_search_finds_decode_plan(book, browser):
    page = open_page(browser, (book / "search.html").as_uri() + "?q=DecodePlan")
    try:
        page.wait_for_selector("#search-results ul.search li", timeout=30_000)
        hits = page.locator("#search-results ul.search li").all_inner_texts()
        assert hits, "searching for DecodePlan found nothing"
    finally:
        page.close()


def test_screenshots(book, browser):
    """The front page and Day 61's chapter (its first page), whole, for a person to look at."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    pages = toc_pages()
    day61 = next((page for page in pages if Path(page).name.startswith("61")), pages[-1])
    for name, source in (("front", pages[0]), ("day61", day61)):
        page = open_page(browser, (book / f"{source}.html").as_uri())
        try:
            page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)
        finally:
            page.close()
        assert (SHOTS / f"{name}.png").stat().st_size > 10_000


def _around(text: str, pattern: re.Pattern) -> str:
    m = pattern.search(text)
    return text[max(0, m.start() - 80): m.end() + 80]
