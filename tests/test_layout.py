"""The package's layout promises: `import nanolab` stays light, and the engine never imports the lab."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import nanolab

PACKAGE = Path(nanolab.__file__).parent


def test_import_nanolab_loads_no_lab_dependency():
    code = ("import sys, nanolab; "
            "print(' '.join(m for m in ('pandas', 'matplotlib', 'transformers', 'aiohttp', 'prometheus_client', "
            "'nanolab.lab', 'nanolab.entrypoints') if m in sys.modules))")
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
    door, no engine module imports `nanolab.llm`, and only the server imports aiohttp and
    prometheus_client."""
    above = ("nanolab.entrypoints", "aiohttp", "prometheus_client")
    layers = {"kernels": ("nanolab.engine", "nanolab.model", "nanolab.llm", *above),
              "model": ("nanolab.engine", "nanolab.llm", *above),
              "engine": ("nanolab.llm", *above)}
    for folder, forbidden in layers.items():
        for path in (PACKAGE / folder).rglob("*.py"):
            bad = [m for m in imported_modules(path) if m.startswith(forbidden)]
            assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"
    for path in (PACKAGE / "entrypoints").rglob("*.py"):
        assert not [m for m in imported_modules(path) if m.startswith("nanolab.lab")], path


ENGINE_PACKAGES = ("nanolab.engine", "nanolab.model", "nanolab.kernels", "nanolab.config", "nanolab.llm",
                   "nanolab.sampling")


def engine_names(tree: ast.AST) -> set[str]:
    """The names a file binds to an engine module or to something imported from one."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith(ENGINE_PACKAGES))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(("nanolab",)):
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full.startswith(ENGINE_PACKAGES) or node.module.startswith(ENGINE_PACKAGES):
                    names.add(a.asname or a.name)
    return names


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def engine_writes(path: Path) -> list[str]:
    """Assignments to an attribute of an engine module or class (`module.NAME = ...`,
    `setattr(module, ...)`, `Class.method = ...`), as "line: source"."""
    tree = ast.parse(path.read_text())
    names = engine_names(tree)
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            targets = [t for t in targets for t in (t.elts if isinstance(t, ast.Tuple) else [t])]
            targets = [t for t in targets if isinstance(t, ast.Attribute)]
            # an attribute of the module or class itself, not of an instance made from it
            targets = [t for t in targets if isinstance(t.value, (ast.Name, ast.Attribute)) and _root(t) in names
                       and not isinstance(t.value, ast.Call)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            targets = [node.args[0]] if node.args and _root(node.args[0]) in names else []
        found += [f"{node.lineno}: {ast.unparse(node)[:80]}" for _ in targets[:1]]
    return found


def test_the_lab_never_assigns_to_the_engine():
    """The lab hands the engine its designs at construction; it never flips a module global or
    swaps a class's method (a lab that did would change every engine in the process)."""
    lab_files = sorted((PACKAGE / "lab").rglob("*.py"))
    assert len(lab_files) > 15
    offenders = {str(p.relative_to(PACKAGE)): engine_writes(p) for p in lab_files}
    assert not {k: v for k, v in offenders.items() if v}


def test_the_check_finds_a_lab_that_flips_an_engine_global(tmp_path):
    flips = tmp_path / "flips.py"
    flips.write_text("from nanolab.kernels import pdl as pdl_module\nfrom nanolab.engine.kv_cache import KVCache\n"
                     "import nanolab.model.attention\n\ndef f(engine, cache):\n    pdl_module.OPS_PDL = True\n"
                     "    KVCache._upload = print\n    setattr(nanolab.model.attention, 'X', 1)\n"
                     "    engine.runner = None\n    cache.x = 1\n")
    assert [line.split(":")[0] for line in engine_writes(flips)] == ["6", "7", "8"]


SWITCH = re.compile(r"[A-Z][A-Z0-9]*_[A-Z0-9_]+")  # a module-level constant's name, as the engine spells them


def test_no_test_flips_an_engine_switch():
    """No module-level switch is left for a test to flip: no test sets an UPPER_CASE constant of
    an engine, model or kernels module."""
    offenders = []
    for path in Path(__file__).parent.glob("test_*.py"):
        tree = ast.parse(path.read_text())
        names = engine_names(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "setattr"):
                continue
            args = node.args
            if len(args) >= 2 and isinstance(args[1], ast.Constant) and _root(args[0]) in names:
                flipped = str(args[1].value)
            elif args and isinstance(args[0], ast.Constant) and str(args[0].value).startswith(ENGINE_PACKAGES):
                flipped = str(args[0].value).rsplit(".", 1)[-1]
            else:
                continue
            if SWITCH.fullmatch(flipped):
                offenders.append(f"{path.name}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert not offenders
