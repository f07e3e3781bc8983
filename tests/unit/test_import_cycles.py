"""No import cycle among sluice's modules, and serving code never imports the training package.

Every module under engine/, kernels/ and http_facade/ is parsed (not imported) and each of its
imports of a ``sluice.`` module becomes an edge, module-level and function-level alike (a lazy
import only hides a cycle until the day someone hoists it). ``from package import name`` is an
edge to the submodule when ``name`` is one, else to the package. A cycle is reported with its
modules in order, so the message says where to cut it.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"engine": "sluice.engine", "kernels": "sluice.kernels", "http_facade": "sluice.http_facade"}


def module_files() -> dict[str, Path]:
    mods = {}
    for folder, package in PACKAGES.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join([package, *parts])] = path
    return mods


def _owner(name: str, mods) -> str | None:
    """The module ``name`` is, or the package it lies in."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    graph = {}
    for mod, path in mods.items():
        here = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            edges |= {t for name in targets if name.startswith("sluice.") and (t := _owner(name, mods))}
        edges.discard(mod)
        graph[mod] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search, colouring the path)."""
    state: dict[str, int] = {}          # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_cycle_finder_finds_cycles_and_only_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"b", "c"}}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"x": {"y"}, "y": {"z"}, "z": {"y"}}) == ["y", "z", "y"]


def test_the_graph_sees_lazy_relative_and_submodule_imports(tmp_path):
    pkg = tmp_path / "engine"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from sluice.engine.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from .. import a\n")
    mods = {"sluice.engine": pkg / "__init__.py", "sluice.engine.sub": pkg / "sub" / "__init__.py",
            "sluice.engine.a": pkg / "a.py", "sluice.engine.sub.b": pkg / "sub" / "b.py"}
    graph = import_graph(mods)
    assert graph["sluice.engine.a"] == {"sluice.engine.sub.b"}
    assert graph["sluice.engine.sub.b"] == {"sluice.engine.a"}
    assert find_cycle(graph) == ["sluice.engine.a", "sluice.engine.sub.b", "sluice.engine.a"]


def test_no_import_cycle_in_the_package():
    mods = module_files()
    assert len(mods) > 100 and "sluice.engine.engine_core" in mods
    cycle = find_cycle(import_graph(mods))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_serving_code_never_imports_the_training_package():
    graph = import_graph(module_files())
    training = {m for m in graph if m.startswith("sluice.engine.training")}
    # engine.cli is the one door: its train-heads command imports the package when it runs.
    importers = {m for m, edges in graph.items() if edges & training and m not in training}
    assert importers == {"sluice.engine.cli"}, sorted(importers)


# engine/DESIGN.md's boundaries, as rules on the graph: (importers' prefix, what they may import
# of sluice; None: nothing of that prefix is checked) per row of its table that a graph can hold.
LAYERS = [
    ("sluice.kernels", lambda t: t.startswith("sluice.kernels")),
    ("sluice.http_facade", lambda t: t.startswith(("sluice.http_facade", "sluice.engine.rpc"))),
    ("sluice.engine.scheduler", lambda t: t in ("sluice.engine.config", "sluice.engine.errors",
                                                "sluice.engine.outputs", "sluice.engine.request")
                                          or t.startswith("sluice.engine.kv_cache")),
    ("sluice.engine.kv_cache", lambda t: t in ("sluice.engine.config", "sluice.engine.errors", "sluice.engine.request")
                                         or t.startswith("sluice.engine.kv_cache")),
]


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for prefix, allowed in LAYERS:
        for mod, edges in graph.items():
            if mod == prefix or mod.startswith(prefix + "."):
                out += [f"{mod} -> {t}" for t in sorted(edges) if not allowed(t)]
    return out


def test_the_layer_rules_flag_an_import_across_a_boundary():
    graph = {"sluice.kernels.paged_decode": {"sluice.engine.attention.base"},
             "sluice.http_facade.app": {"sluice.engine.rpc.engine_pb2", "sluice.engine.sampler"},
             "sluice.engine.scheduler": {"sluice.engine.spec_decode.eagle", "sluice.engine.request"},
             "sluice.engine.kv_cache.block_pool": {"sluice.engine.kv_cache.utils"}}
    assert layer_violations(graph) == ["sluice.kernels.paged_decode -> sluice.engine.attention.base",
                                       "sluice.http_facade.app -> sluice.engine.sampler",
                                       "sluice.engine.scheduler -> sluice.engine.spec_decode.eagle"]


def test_packages_import_only_across_the_boundaries_the_design_allows():
    assert layer_violations(import_graph(module_files())) == []
