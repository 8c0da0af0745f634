"""Where data may travel (ARCHITECTURE §2): the runner reads step rows, never the engine's requests;
models never import the engine. Checked on the source with an AST walk, so a lazy or
``TYPE_CHECKING`` import counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import deepinfer

PACKAGE = Path(deepinfer.__file__).parent


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, and every ``module.name`` it takes from a ``from`` import."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


@pytest.mark.parametrize("module", ["engine/runner.py", "engine/graphs.py", "engine/context.py", "rows.py",
                                    "structured/masks.py"])
def test_the_step_path_reads_rows_not_requests(module: str) -> None:
    imported = imports_of(PACKAGE / module)
    forbidden = {"deepinfer.engine.scheduler", "deepinfer.engine.request", "deepinfer.engine.core"}
    assert not imported & forbidden, f"{module} imports {sorted(imported & forbidden)}"
    assert not any(name.endswith((".Request", ".ScheduledRequest", ".SchedulerOutput")) for name in imported)


def test_models_import_nothing_from_the_engine() -> None:
    offenders = {str(path.relative_to(PACKAGE)): sorted(n for n in imports_of(path)
                                                        if n.startswith(("deepinfer.engine", "deepinfer.parallel")))
                 for path in (PACKAGE / "model").rglob("*.py")}
    assert {k: v for k, v in offenders.items() if v} == {}
