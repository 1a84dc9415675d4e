"""The package's import structure: no cycles, and the pure layers stay pure.

Read from the source with ``ast`` (no third-party tool): every ``import`` of a kvray module
is an edge; imports under ``if TYPE_CHECKING:`` are not. Imports inside functions run only
when called, so they count for cycles but not for what a module pulls in at import time.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import kvray

ROOT = Path(kvray.__file__).parent
PURE = ("kvray.scheduler", "kvray.config", "kvray.sampling_params", "kvray.serve.protocol",
        "kvray.outputs", "kvray.tokenizer", "kvray.actors.executor")
FORBIDDEN_EXTERNAL = ("torch", "ray")
FORBIDDEN_INTERNAL = "kvray.engine"


@dataclass(frozen=True)
class Import:
    target: str  # absolute dotted name as written (module or module.attribute)
    at_import_time: bool  # module level (or class body), not inside a function


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(module: str) -> list[Import]:
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub, in_function)
                continue
            if isinstance(child, ast.Import):
                found.extend(Import(a.name, not in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: resolve against this module's package
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                found.append(Import(base, not in_function))
                found.extend(Import(f"{base}.{a.name}", not in_function) for a in child.names)
            visit(child, in_function or isinstance(
                child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda))

    visit(ast.parse(path.read_text()), False)
    return found


def internal_edges(module: str, import_time_only: bool) -> set[str]:
    """kvray modules ``module`` imports (``from a import b`` names module a.b when it is one)."""
    return {i.target for i in imports_of(module)
            if i.target in MODULES and i.target != module
            and (i.at_import_time or not import_time_only)}


def parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:k]) for k in range(1, len(parts))]


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


def test_the_import_graph_sees_the_package():
    # Guards the reader itself: a parser that found no edges would pass everything below.
    assert {"kvray.scheduler.scheduler", "kvray.serve.openai_app"} <= set(MODULES)
    assert "kvray.scheduler.kv_cache_manager" in internal_edges("kvray.scheduler.scheduler",
                                                                  True)
    assert "kvray.serve.completions" in internal_edges("kvray.serve.openai_app", True)
    assert "kvray.actors.ray_executor" in internal_edges("kvray.actors.executor", False)
    assert "kvray.actors.ray_executor" not in internal_edges("kvray.actors.executor", True)


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
