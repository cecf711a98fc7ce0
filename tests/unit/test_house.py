"""The house rules of DESIGN.md section 2, kept by walking the package's source (issue #63):
no file over 500 lines, no class over 30 methods, no two modules named pipeline.py, no module
importing another module's private names, and the two executors sharing at most 6 method names
outside the Executor protocol. A change that breaks one fails here, naming the file."""
import ast
import importlib.util
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "raf_dist"
MAX_LINES = 500
MAX_METHODS = 30  # every def in a class body: properties and dunders included
SOURCES = sorted(PACKAGE.rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def test_the_walk_sees_the_package():
    assert len(SOURCES) > 100 and (PACKAGE / "trainer.py") in SOURCES


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_file_over_500_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE)}: {lines} lines (split its ideas)"


def test_no_class_over_30_methods():
    big = []
    for path in SOURCES:
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ClassDef):
                defs = [n for n in node.body
                        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                if len(defs) > MAX_METHODS:
                    big.append(f"{path.relative_to(PACKAGE)}:{node.name} ({len(defs)})")
    assert not big, f"classes over {MAX_METHODS} methods: {big}"


def test_module_names_tell_rooms_apart():
    assert not [p for p in SOURCES if p.name == "pipeline.py"], \
        "a module called pipeline.py: name the room (stage_split, pipeline_executor, ...)"


def _private_imports(path: Path):
    """(line, 'from X import _y') for every underscore NAME imported from another module
    (importing a private module such as ``_native`` is fine: it is a module, not a name)."""
    package = _module_name(path) if path.name == "__init__.py" else \
        _module_name(path).rpartition(".")[0]
    for node in ast.walk(_tree(path)):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")
            anchor = anchor[:len(anchor) - node.level + 1]
            base = ".".join(anchor + ([node.module] if node.module else []))
        for alias in node.names:
            if not alias.name.startswith("_") or alias.name.startswith("__"):
                continue
            if importlib.util.find_spec(f"{base}.{alias.name}") is not None:
                continue  # a private module of the package, not a private name
            yield node.lineno, f"from {base} import {alias.name}"


def test_no_module_imports_another_modules_private_names():
    found = [f"{p.relative_to(PACKAGE)}:{line}: {text}" for p in SOURCES
             for line, text in _private_imports(p)]
    assert not found, "private names imported across modules (make them public where " \
                      f"they belong): {found}"


def test_the_two_executors_share_at_most_six_names_outside_the_protocol():
    from raf_dist.runtime import executor, pipeline_executor, spmd_executor

    protocol = {n for n in vars(executor.Executor) if not n.startswith("__")}
    spmd = {n for n in vars(spmd_executor.SPMDExecutor) if not n.startswith("__")}
    pipe = {n for n in vars(pipeline_executor.PipelineExecutor) if not n.startswith("__")}
    shared = (spmd & pipe) - protocol
    assert len(shared) <= 6, f"defined in both executors: {sorted(shared)}"
