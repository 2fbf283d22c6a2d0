"""The package's layout promises: `import nanolab` stays light, and the engine never imports the lab."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import nanolab

PACKAGE = Path(nanolab.__file__).parent


def test_import_nanolab_loads_no_lab_dependency():
    code = ("import sys, nanolab; "
            "print(' '.join(m for m in ('pandas', 'matplotlib', 'transformers', 'aiohttp', 'nanolab.lab', "
            "'nanolab.entrypoints') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"import nanolab loaded {out}"


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-local imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from nanolab import lab`
    return names


def test_the_engine_never_imports_the_lab():
    engine_files = [p for p in PACKAGE.rglob("*.py") if "lab" not in p.relative_to(PACKAGE).parts
                    and p.name != "__main__.py"]  # the CLI runs the lab's benches on request
    assert len(engine_files) > 15
    offenders = {str(p.relative_to(PACKAGE)): sorted(m for m in imported_modules(p) if m.startswith("nanolab.lab"))
                 for p in engine_files}
    assert not {k: v for k, v in offenders.items() if v}


def test_data_flows_down_from_llm_to_the_kernels():
    """The kernels import no engine module, the model imports neither the engine nor the LLM front
    door, no engine module imports `nanolab.llm`, and only the server imports aiohttp."""
    above = ("nanolab.entrypoints", "aiohttp")
    layers = {"kernels": ("nanolab.engine", "nanolab.model", "nanolab.llm", *above),
              "model": ("nanolab.engine", "nanolab.llm", *above),
              "engine": ("nanolab.llm", *above)}
    for folder, forbidden in layers.items():
        for path in (PACKAGE / folder).rglob("*.py"):
            bad = [m for m in imported_modules(path) if m.startswith(forbidden)]
            assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"
    for path in (PACKAGE / "entrypoints").rglob("*.py"):
        assert not [m for m in imported_modules(path) if m.startswith("nanolab.lab")], path
