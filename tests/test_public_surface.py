"""The declared public surface (ARCHITECTURE §2, docs/design.md "Public modules"): what a plugin may
import from the core, which core modules stay below the engine, and a config value no part of the
engine would use (``cache.kv_store``) refused at start-up instead of accepted and ignored.

The import tests read source with ``ast`` (nothing is imported), so an import inside a function or under
``TYPE_CHECKING`` counts like any other."""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

import deepinfer
from deepinfer import hookimpl
from deepinfer.errors import ConfigError
from deepinfer.plugins import PluginHost

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "deepinfer"

# The core modules a plugin may import (docs/design.md); ``deepinfer`` itself only for its ``__all__``.
PUBLIC_MODULES = frozenset({
    "deepinfer.config", "deepinfer.errors", "deepinfer.hookspecs", "deepinfer.interfaces", "deepinfer.ops",
    "deepinfer.outputs", "deepinfer.testing",
})
# Modules below the engine: none of them may reach engine/ or parallel/ through the core's own imports.
BELOW_ENGINE_PACKAGES = ("model", "kv", "sampling", "structured")
BELOW_ENGINE_MODULES = ("interfaces", "hookspecs", "outputs")
ABOVE = ("deepinfer.engine", "deepinfer.parallel")
# Modules below the engine allowed to import it (none since issue 22: the runner is in engine/, step rows
# are deepinfer/rows.py, and the grammar bookkeeping over requests is engine/structured.py). Each entry
# must still be needed.
ISSUE_22_EXCEPTIONS: frozenset[str] = frozenset()


def imported_names(tree: ast.AST) -> Iterator[tuple[int, str, str | None]]:
    """``(line, module, name)`` for every absolute ``deepinfer`` import in ``tree`` (``name`` None for
    ``import x``), plus ``importlib.import_module("deepinfer...")`` calls with a constant name."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "deepinfer":
                    yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "deepinfer":
                for alias in node.names:
                    yield node.lineno, node.module, alias.name
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and node.args[0].value.split(".")[0] == "deepinfer"):
            yield node.lineno, node.args[0].value, None


def core_modules() -> dict[str, Path]:
    """Every module of the core package by dotted name."""
    modules = {}
    for path in CORE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imported_module(module: str, name: str | None, known: set[str]) -> str:
    """The module an import statement loads: ``from a import b`` loads ``a.b`` when that is a module."""
    if name is not None and f"{module}.{name}" in known:
        return f"{module}.{name}"
    return module


def plugin_sources() -> dict[str, list[Path]]:
    """Each plugin's package files, found from its ``pyproject.toml`` entry point (what an installed
    distribution loads), and the test suite's third-party plugins (``tests/thirdparty``)."""
    sources: dict[str, list[Path]] = {}
    for project in sorted((ROOT / "plugins").glob("*/pyproject.toml")):
        meta = tomllib.loads(project.read_text())
        for value in meta["project"]["entry-points"]["deepinfer.plugins"].values():
            package = value.split(":")[0].split(".")[0]
            sources[package] = sorted((project.parent / package).rglob("*.py"))
    sources["tests/thirdparty"] = sorted((ROOT / "tests" / "thirdparty").glob("*.py"))
    return sources


def test_plugins_import_only_the_public_modules() -> None:
    sources = plugin_sources()
    assert len(sources) >= 6 and all(sources.values()), sources  # five plugins + the third-party ones
    known = set(core_modules())
    offenders = []
    # ``import deepinfer`` then ``deepinfer.engine...``: attribute access reaches a module too.
    allowed_attrs = {*deepinfer.__all__, "__version__", *(m.removeprefix("deepinfer.") for m in PUBLIC_MODULES)}
    for files in sources.values():
        for path in files:
            tree = ast.parse(path.read_text(), str(path))
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno}: deepinfer.{node.attr}" for node in ast.walk(tree)
                          if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                          and node.value.id == "deepinfer" and node.attr not in allowed_attrs]
            for line, module, name in imported_names(tree):
                target = imported_module(module, name, known)
                if target == "deepinfer":
                    if name is not None and name not in deepinfer.__all__:
                        offenders.append(f"{path.relative_to(ROOT)}:{line}: deepinfer.{name}")
                elif target not in PUBLIC_MODULES:
                    offenders.append(f"{path.relative_to(ROOT)}:{line}: {target}")
    assert not offenders, ("plugins import core modules outside the public list "
                           f"{sorted(PUBLIC_MODULES)}:\n" + "\n".join(offenders))


def test_the_public_modules_exist_and_name_what_they_export() -> None:
    known = set(core_modules())
    assert known >= PUBLIC_MODULES, PUBLIC_MODULES - known
    from deepinfer import ops, testing

    for module in (ops, testing):
        assert module.__doc__ and "stable within a minor version" in module.__doc__
        missing = [name for name in module.__all__ if not hasattr(module, name)]
        assert not missing, (module.__name__, missing)
        undocumented = [name for name in module.__all__ if f"``{name}" not in module.__doc__]
        assert not undocumented, (module.__name__, undocumented)


def reaches_above(start: str, edges: dict[str, set[str]]) -> list[str] | None:
    """The first import chain from ``start`` into ``engine/`` or ``parallel/``, or None."""
    seen, stack = {start}, [[start]]
    while stack:
        chain = stack.pop()
        for target in sorted(edges.get(chain[-1], ())):
            if target.startswith(ABOVE):
                return [*chain, target]
            if target not in seen:
                seen.add(target)
                stack.append([*chain, target])
    return None


def test_nothing_below_the_engine_imports_engine_or_parallel() -> None:
    modules = core_modules()
    known = set(modules)
    edges = {name: {imported_module(m, n, known) for _, m, n in imported_names(ast.parse(path.read_text()))}
             for name, path in modules.items()}
    below = sorted(name for name in modules
                   if name.split(".")[1:2] and (name.split(".")[1] in BELOW_ENGINE_PACKAGES
                                                or name.split(".")[1] in BELOW_ENGINE_MODULES))
    assert {"deepinfer.interfaces", "deepinfer.hookspecs", "deepinfer.outputs", "deepinfer.kv.blocks",
            "deepinfer.model.llama", "deepinfer.sampling.rng", "deepinfer.structured.grammar"} <= set(below)
    chains = {name: reaches_above(name, edges) for name in below}
    offenders = [" -> ".join(chain) for name, chain in chains.items() if chain and name not in ISSUE_22_EXCEPTIONS]
    assert not offenders, "modules below the engine import engine/ or parallel/:\n" + "\n".join(offenders)
    stale = sorted(name for name in ISSUE_22_EXCEPTIONS if not chains.get(name))
    assert not stale, f"no longer needed (issue 22 landed?): remove {stale} from ISSUE_22_EXCEPTIONS"


def test_the_hook_contract_imports_no_engine_model_or_parallel() -> None:
    """``interfaces.py`` and ``hookspecs.py`` (and the payloads they name, ``outputs.py``) point down only."""
    for name in ("interfaces", "hookspecs", "outputs"):
        tree = ast.parse((CORE / f"{name}.py").read_text())
        bad = [module for _, module, _ in imported_names(tree)
               if module.startswith(("deepinfer.engine", "deepinfer.model", "deepinfer.parallel"))]
        assert not bad, (name, bad)


# ------------------------------------------------------------------------------------ cache.kv_store


class HostStorePlugin:
    """Offers one KV store, ``host``, the way a KV-tier plugin would."""

    @hookimpl
    def deepinfer_kv_stores(self) -> dict[str, object]:
        return {"host": lambda spec: None}


def test_a_kv_store_nobody_offers_fails_at_start_up(clean_deepinfer_env: None, tiny_llama_dir: Path) -> None:
    from deepinfer import LLM

    with pytest.raises(ConfigError, match=r"cache\.kv_store: unknown store 'redis://localhost:6379'; "
                                          r"offered: none\. Enable the plugin that offers it or leave "
                                          r"cache\.kv_store unset"):
        LLM(tiny_llama_dir, cache={"kv_store": "redis://localhost:6379"}, kv_cache_bytes=1 << 20, block_size=16)


def test_a_kv_store_error_lists_the_offered_stores_and_an_offered_one_is_accepted() -> None:
    host = PluginHost({}, installed={}, extra=[("hoststore", HostStorePlugin())])
    host.check_kv_store(None)  # unset: nothing to check
    assert host.kv_store_factories(None) == []
    with pytest.raises(ConfigError, match=r"unknown store 'disk'; offered: host \(plugin hoststore\)"):
        host.check_kv_store("disk")
    with pytest.raises(ConfigError, match=r"unknown store 'disk'; offered: host \(plugin hoststore\)"):
        host.check_kv_store("host+disk")  # a chain: every name must be offered
    host.check_kv_store("host")  # offered: the engine builds it (issue 34, plugins/kv_store)
    assert len(host.kv_store_factories("host")) == 1


def test_a_parallel_run_refuses_the_kv_store_before_starting_ranks(clean_deepinfer_env: None,
                                                                  tiny_llama_dir: Path) -> None:
    from deepinfer.parallel.driver import ParallelEngine

    with pytest.raises(ConfigError, match=r"cache\.kv_store: unknown store 'redis://x'"):
        ParallelEngine(str(tiny_llama_dir), overrides={"cache": {"kv_store": "redis://x"},
                                                        "parallel": {"data_parallel_size": 2}})
