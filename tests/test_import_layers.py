"""The package's import structure: layers with floors, no cycles, and pure layers stay pure.

Read from the source with ``ast`` (no third-party tool). Every ``import`` of a kvray module
is an edge, tagged with where it sits: at module level (runs on import), inside a function
(runs when called) or under ``if TYPE_CHECKING:`` (never runs, but is still a dependency).

- **Floors**: a module imports only from its own layer or lower ones (:data:`LAYERS`), every
  kind of import counted, type-only ones included. Every module must have a layer.
- **Cycles**: none, counting module-level and function-level imports.
- **Purity**: the pure layers pull in neither torch nor ray nor the engine when imported.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

import kvray

pytestmark = pytest.mark.unit

ROOT = Path(kvray.__file__).parent
FACADE = "kvray"  # kvray/__init__.py: the public API, exempt from the floors
# A module's layer is that of the longest prefix naming it; higher layers build on lower ones.
LAYERS: Mapping[str, float] = {
    "kvray.cli": 7, "kvray.bench": 7, "kvray.cli_flags": 7, "kvray.ops": 7, "kvray.testing": 7,
    "kvray.utils": 7,  # vLLM's argument helpers, over the CLI's flags
    "kvray.serve": 6,
    "kvray.engine": 5,
    "kvray.actors": 4,
    "kvray.scheduler": 3,
    "kvray.lora": 2.5,  # adapters: read against the model spec; the workers' slots
    "kvray.models": 2,
    # API and value types
    "kvray.config": 1.5, "kvray.sampling_params": 1.5, "kvray.outputs": 1.5,
    "kvray.inputs": 1.5, "kvray.tokenizer": 1.5, "kvray.structured_output": 1.5,
    "kvray.lora.request": 1.5,
    "kvray.kernels": 1, "kvray.quant": 1,
    "kvray.errors": 0, "kvray.hardware": 0, "kvray.parallel": 0,
}
PURE = ("kvray.scheduler", "kvray.config", "kvray.sampling_params", "kvray.serve.protocol",
        "kvray.outputs", "kvray.inputs", "kvray.tokenizer", "kvray.actors.executor",
        "kvray.lora.request",
        "kvray.serve.prefix_index", "kvray.serve.reasoning", "kvray.models.expert_placement")
FORBIDDEN_EXTERNAL = ("torch", "ray")
FORBIDDEN_INTERNAL = "kvray.engine"


@dataclass(frozen=True)
class Import:
    target: str  # absolute dotted name as written (module or module.attribute)
    at_import_time: bool  # module level (or class body), not inside a function
    type_only: bool = False  # under ``if TYPE_CHECKING:``


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


# ---- reading imports --------------------------------------------------------------------
def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_in_source(module: str, source: str, is_package: bool = False) -> list[Import]:
    """Every import in ``source``, the text of ``module`` (a package's ``__init__`` when
    ``is_package``), relative ones made absolute."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.body:
                    visit_statement(sub, in_function, True)
                for sub in child.orelse:
                    visit_statement(sub, in_function, type_only)
                continue
            visit_statement(child, in_function, type_only)

    def visit_statement(child: ast.AST, in_function: bool, type_only: bool) -> None:
        now = not in_function and not type_only
        if isinstance(child, ast.Import):
            found.extend(Import(a.name, now, type_only) for a in child.names)
        elif isinstance(child, ast.ImportFrom):
            base = child.module or ""
            if child.level:  # relative: resolve against this module's package
                anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.append(Import(base, now, type_only))
            found.extend(Import(f"{base}.{a.name}", now, type_only) for a in child.names)
        visit(child, in_function or isinstance(
            child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda), type_only)

    visit(ast.parse(source), False, False)
    return found


def imports_of(module: str) -> list[Import]:
    path = MODULES[module]
    return imports_in_source(module, path.read_text(), path.name == "__init__.py")


def internal_edges(module: str, import_time_only: bool) -> set[str]:
    """kvray modules ``module`` imports, type-only imports aside (``from a import b`` names
    module a.b when it is one)."""
    return {i.target for i in imports_of(module)
            if i.target in MODULES and i.target != module and not i.type_only
            and (i.at_import_time or not import_time_only)}


def parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:k]) for k in range(1, len(parts))]


# ---- floors -----------------------------------------------------------------------------
def layer_of(module: str) -> float | None:
    """The layer of the longest :data:`LAYERS` prefix naming ``module``; None if none does."""
    owners = [p for p in LAYERS if module == p or module.startswith(p + ".")]
    return LAYERS[max(owners, key=len)] if owners else None


def unassigned(modules: Iterable[str]) -> list[str]:
    return sorted(m for m in modules if m != FACADE and layer_of(m) is None)


def _resolve(target: str, modules: Iterable[str]) -> str | None:
    """The kvray module an import target lands in (``a.b.Name`` -> ``a.b``)."""
    known = set(modules)
    for candidate in [target, *reversed(parents(target))]:
        if candidate in known:
            return candidate
    return None


def facade_layer() -> float:
    """Importing the facade runs what it imports at import time: it sits above those."""
    return max((layer_of(m) or 0) for m in internal_edges(FACADE, import_time_only=True))


def floor_violations(module: str, imports: Iterable[Import],
                     modules: Iterable[str] = MODULES) -> list[str]:
    """Each import of ``module`` that reaches above its layer, type-only ones included."""
    own = layer_of(module)
    if module == FACADE or own is None:
        return []
    problems = []
    for imp in imports:
        target = _resolve(imp.target, modules)
        if target is None or target == module:
            continue
        layer = facade_layer() if target == FACADE else layer_of(target)
        if layer is not None and layer > own:
            how = (" (type-only)" if imp.type_only
                   else "" if imp.at_import_time else " (in a function)")
            problems.append(f"{module} (layer {own:g}) imports {imp.target} "
                            f"(layer {layer:g}){how}")
    return problems


# ---- cycles and purity ------------------------------------------------------------------
def import_time_closure(module: str) -> set[str]:
    """Every kvray module executed by ``import module`` (parent packages included)."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo.extend(parents(m))
        todo.extend(internal_edges(m, import_time_only=True))
    return seen


def find_cycle() -> list[str] | None:
    graph = {m: sorted(internal_edges(m, import_time_only=False)) for m in MODULES}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def dfs(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in graph[m]:
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (cycle := dfs(n)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := dfs(m)):
            return cycle
    return None


def pure_modules() -> list[str]:
    return sorted(m for m in MODULES if any(m == p or m.startswith(p + ".") for p in PURE))


# ---- tests ------------------------------------------------------------------------------
def test_the_import_graph_sees_the_package():
    # Guards the reader itself: a parser that found no edges would pass everything below.
    assert {"kvray.scheduler.scheduler", "kvray.serve.openai_app"} <= set(MODULES)
    assert "kvray.scheduler.kv_cache_manager" in internal_edges("kvray.scheduler.scheduler",
                                                                  True)
    assert "kvray.serve.completions" in internal_edges("kvray.serve.openai_app", True)
    assert "kvray.actors.ray_executor" in internal_edges("kvray.actors.executor", False)
    assert "kvray.actors.ray_executor" not in internal_edges("kvray.actors.executor", True)


def test_every_kvray_module_has_a_layer():
    assert not unassigned(MODULES), (
        f"give these modules a layer in LAYERS (tests/test_import_layers.py): "
        f"{unassigned(MODULES)}")


def test_kvray_modules_import_only_from_their_layer_or_below():
    problems = [p for m in sorted(MODULES) for p in floor_violations(m, imports_of(m))]
    assert not problems, "upward imports:\n" + "\n".join(problems)


def test_kvray_modules_import_each_other_without_cycles():
    assert find_cycle() is None, f"import cycle: {' -> '.join(find_cycle())}"


def test_pure_layers_import_neither_torch_nor_ray_nor_the_engine():
    problems = []
    for module in pure_modules():
        for dep in sorted(import_time_closure(module)):
            if dep == FORBIDDEN_INTERNAL or dep.startswith(FORBIDDEN_INTERNAL + "."):
                problems.append(f"{module} imports {dep}")
            for imp in imports_of(dep):
                top = imp.target.split(".")[0]
                if imp.at_import_time and top in FORBIDDEN_EXTERNAL:
                    problems.append(f"{module} imports {imp.target} (via {dep})")
    assert not problems, "\n".join(sorted(set(problems)))


def test_pure_layers_load_without_torch_or_ray_at_run_time():
    # The same promise checked by Python itself, in a fresh interpreter.
    code = ("import sys\n" + "".join(f"import {m}\n" for m in pure_modules())
            + "bad = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'ray'}"
            " | {m for m in sys.modules if m.startswith('kvray.engine')})\n"
            "assert not bad, bad\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr


# ---- the checker catches what it is for (synthetic sources; the tree is not touched) --------
MUTANT = """
from __future__ import annotations
from typing import TYPE_CHECKING
import torch
from kvray.errors import KVRayError
from ..models.spec import ModelSpec
if TYPE_CHECKING:
    from kvray.sampling_params import SamplingParams
else:
    from kvray.hardware import describe

def plan():
    from kvray import LLM
    from kvray.scheduler import scheduler
"""


def test_the_floor_check_reports_upward_imports_of_every_kind():
    imports = imports_in_source("kvray.kernels.mutant", MUTANT)
    modules = [*MODULES, "kvray.kernels.mutant"]
    problems = floor_violations("kvray.kernels.mutant", imports, modules)
    facade = f"{facade_layer():g}"
    assert problems == [
        "kvray.kernels.mutant (layer 1) imports kvray.models.spec (layer 2)",
        "kvray.kernels.mutant (layer 1) imports kvray.models.spec.ModelSpec (layer 2)",
        "kvray.kernels.mutant (layer 1) imports kvray.sampling_params (layer 1.5) "
        "(type-only)",
        "kvray.kernels.mutant (layer 1) imports kvray.sampling_params.SamplingParams "
        "(layer 1.5) (type-only)",
        f"kvray.kernels.mutant (layer 1) imports kvray (layer {facade}) (in a function)",
        f"kvray.kernels.mutant (layer 1) imports kvray.LLM (layer {facade}) (in a function)",
        "kvray.kernels.mutant (layer 1) imports kvray.scheduler (layer 3) (in a function)",
        "kvray.kernels.mutant (layer 1) imports kvray.scheduler.scheduler (layer 3) "
        "(in a function)",
    ]
    # What is at its layer or below passes, and so would the same source one layer up.
    assert floor_violations("kvray.scheduler.mutant", imports, modules) == []


def test_a_module_without_a_layer_is_named():
    assert unassigned(["kvray.kernels.attention", "kvray.newthing.module", FACADE]) == [
        "kvray.newthing.module"]
