"""The rules of docs/architecture.md that the source shows: which stage may import which,
no import cycles, and vLLM changed only by the plugin's patch functions.

Every module of `vllm_dspine/` is parsed with `ast` (nothing is imported: no torch, no
vLLM, well under a second). An import anywhere in a module counts, at its top or inside a
function, since a function-level import is still a dependency, only a later one.
`from P import name` points to the module `P.name` where that is a module of ours, else
to `P`. The failures print the offending edges as `importer:line -> imported`.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "vllm_dspine"
PACKAGE_DIR = Path(__file__).resolve().parent.parent / PACKAGE

# The stages of docs/architecture.md (rule "Imports point down the stages"): a module's
# stage is its folder under vllm_dspine/; the top-level modules (config, proposal,
# hf_config, cpu_env, step_profile, the package itself) are `shared`. Each stage may
# import only the stages listed for it (and itself).
ALLOWED = {
    "shared": set(),
    "kernels": {"shared"},
    "model": {"shared", "kernels"},
    "verify": {"shared", "kernels"},
    "commit": {"shared", "kernels"},
    "proposer": {"shared", "kernels", "model", "verify", "commit"},
    "plugin": {"shared", "kernels", "model", "verify", "commit", "proposer"},
    "serving": {"shared", "kernels", "model", "verify", "commit", "proposer", "plugin"},
    "train": {"shared", "kernels", "model"},
    "pairs": {"shared", "kernels", "model", "train"},
}


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    line: int

    def __str__(self) -> str:
        return f"{self.importer}:{self.line} -> {self.imported}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def stage_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) >= 2 and (PACKAGE_DIR / parts[1]).is_dir():
        return parts[1]
    return "shared"


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[Edge]:
    """Every import of one of our modules by `module`, at any depth of its code."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    edges = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against the importing package
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # `from P import sub` names the submodule P.sub; anything else is P itself.
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules
                       else source for alias in node.names]
        else:
            continue
        for target in targets:
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                # `import vllm_dspine.a.b` of a name that is not a module: its package.
                while target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target != module:
                    edges.add(Edge(module, target, node.lineno))
    return sorted(edges, key=lambda e: (e.line, e.imported))


def import_graph() -> list[Edge]:
    modules = package_modules()
    return [e for m, p in modules.items() for e in imports_of(m, p, modules)]


def stage_violations(edges: list[Edge]) -> list[Edge]:
    return [e for e in edges
            if stage_of(e.imported) != stage_of(e.importer)
            and stage_of(e.imported) not in ALLOWED[stage_of(e.importer)]]


def cycles(edges: list[Edge]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    graph = defaultdict(set)
    for e in edges:
        graph[e.importer].add(e.imported)
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def format_edges(edges: list[Edge]) -> str:
    return "\n".join(f"  {e}  ({stage_of(e.importer)} -> {stage_of(e.imported)})"
                     for e in sorted(edges, key=str))


def test_every_folder_of_the_package_has_a_stage():
    """A new folder must be placed in the order before its imports can be judged."""
    folders = {stage_of(m) for m in package_modules()}
    assert folders <= set(ALLOWED), (
        f"folders without a stage in ALLOWED (add them here and to "
        f"docs/architecture.md): {sorted(folders - set(ALLOWED))}")


def test_stage_table_has_no_circle():
    """ALLOWED itself must be an order: no two stages may each import the other."""
    edges = [Edge(a, b, 0) for a, allowed in ALLOWED.items() for b in allowed]
    assert cycles(edges) == []


def test_imports_point_down_the_stages():
    edges = import_graph()
    bad = stage_violations(edges)
    assert not bad, ("imports against the stage order of docs/architecture.md "
                     "(importer:line -> imported):\n" + format_edges(bad))


def test_nothing_below_the_plugin_imports_it():
    """The plugin is vLLM's entry into the package; only `serving` (which checks that
    vLLM ran it) may look back at it."""
    bad = [e for e in import_graph()
           if stage_of(e.imported) == "plugin"
           and stage_of(e.importer) not in ("plugin", "serving")]
    assert not bad, "imports of vllm_dspine.plugin from below it:\n" + format_edges(bad)


def test_no_import_cycles_between_modules():
    edges = import_graph()
    found = cycles(edges)
    detail = [e for e in edges
              if any(e.importer in c and e.imported in c for c in found)]
    assert not found, ("import cycles (each line a module set that imports itself "
                       "round):\n" + "\n".join(f"  {c}" for c in found)
                       + "\nedges inside them:\n" + format_edges(detail))


def vllm_changes(path: Path) -> list[tuple[int, str, bool]]:
    """Assignments to (and setattr/delattr on) an attribute of a name the module imported
    from vLLM, e.g. `GPUModelRunner._sample = ...`: (line, code, inside a function)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    vllm_names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            vllm_names |= {(a.asname or a.name).split(".")[0] for a in node.names
                           if a.name.split(".")[0] == "vllm"}
        elif isinstance(node, ast.ImportFrom) and not node.level \
                and (node.module or "").split(".")[0] == "vllm":
            vllm_names |= {a.asname or a.name for a in node.names}

    def root_name(expr: ast.expr) -> str | None:
        while isinstance(expr, (ast.Attribute, ast.Subscript)):
            expr = expr.value
        return expr.id if isinstance(expr, ast.Name) else None

    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and root_name(t) in vllm_names:
                    found.append((node.lineno, ast.unparse(target), in_function))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("setattr", "delattr") and node.args \
                and root_name(node.args[0]) in vllm_names:
            found.append((node.lineno, ast.unparse(node), in_function))
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                 ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, False)
    return found


def test_vllm_is_changed_only_by_the_plugin_and_never_on_import():
    """docs/architecture.md: every replacement of a vLLM symbol is in plugin/, inside the
    functions `apply_patches()` runs; importing a module changes nothing of vLLM's."""
    bad = []
    for module, path in package_modules().items():
        for line, code, in_function in vllm_changes(path):
            if stage_of(module) != "plugin":
                bad.append(f"  {module}:{line}: {code}  (outside plugin/)")
            elif not in_function:
                bad.append(f"  {module}:{line}: {code}  (at import time)")
    assert not bad, "changes to vLLM outside the plugin's patch functions:\n" + "\n".join(bad)


def test_train_does_not_import_pairs():
    bad = [e for e in import_graph()
           if stage_of(e.importer) == "train" and stage_of(e.imported) == "pairs"]
    assert not bad, ("train imports pairs (pairs may use train, never the other way "
                     "round):\n" + format_edges(bad))


def test_the_checker_sees_function_level_and_relative_imports(tmp_path):
    """The parser itself: a function-level import, a relative import and
    `from package import submodule` all become edges to the right module."""
    source = ("import os\n"
              "from vllm_dspine.config import DSpineConfig\n"
              "def f():\n"
              "    from ..kernels import bridge_ref\n"
              "    from . import drafter\n"
              "    import vllm_dspine.kernels.tail_ref\n")
    path = tmp_path / "probe.py"
    path.write_text(source)
    modules = package_modules()
    edges = imports_of("vllm_dspine.model.probe", path, modules)
    assert [(e.imported, e.line) for e in edges] == [
        ("vllm_dspine.config", 2), ("vllm_dspine.kernels.bridge_ref", 4),
        ("vllm_dspine.model.drafter", 5), ("vllm_dspine.kernels.tail_ref", 6)]
    assert stage_violations([Edge("vllm_dspine.kernels.tail", "vllm_dspine.model.drafter",
                                  1)])
    assert cycles([Edge("a", "b", 1), Edge("b", "c", 1), Edge("c", "a", 1),
                   Edge("c", "d", 1)]) == [["a", "b", "c"]]
    probe = tmp_path / "patcher.py"
    probe.write_text("from vllm.v1.worker import gpu_model_runner as gmr\n"
                     "gmr.X = 1\n"
                     "def apply():\n"
                     "    setattr(gmr.GPUModelRunner, 'f', None)\n"
                     "    self_runner.rejection_sampler = None\n")
    assert vllm_changes(probe) == [
        (2, "gmr.X", False), (4, "setattr(gmr.GPUModelRunner, 'f', None)", True)]
