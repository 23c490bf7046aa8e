"""Check the patch table against a vLLM source tree without running it.

    python -m vllm_dspine.plugin.patches.check_source DIR

DIR holds the `vllm/` package (or is it): an unpacked wheel of any vLLM version. Each
row's symbols are looked up in the parsed source (`ast`, nothing imported): the module
file, the class or function (followed through `from ... import` and base classes), its
parameters as `inspect.signature` would report them on the attribute, the names its
body refers to, and where a name is imported from. Symbols of other packages
(transformers) are skipped: they are not in a vLLM tree. Exit status 0 when every row
would apply unchanged. docs/compatibility.md lists what this found for 0.33.0 / 0.34.0.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from vllm_dspine.plugin.patches.table import PATCHES, Patch, Symbol

_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


class Missing(Exception):
    pass


class SourceTree:
    """Python packages under `root`, read as source."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._parsed: dict[str, ast.Module | None] = {}

    # ---------------------------------------------------------------- modules
    def module_file(self, module: str) -> Path | None:
        base = self.root.joinpath(*module.split("."))
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path
        return None

    def has_package(self, module: str) -> bool:
        return self.module_file(module.split(".")[0]) is not None

    def parse(self, module: str) -> ast.Module:
        if module not in self._parsed:
            path = self.module_file(module)
            self._parsed[module] = None if path is None else ast.parse(path.read_text())
        tree = self._parsed[module]
        if tree is None:
            raise Missing(f"module `{module}` is missing")
        return tree

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        path = self.module_file(module)
        package = module.split(".")
        if path is not None and path.name != "__init__.py":
            package = package[:-1]
        package = package[: len(package) - (node.level - 1)]
        return ".".join(package + ([node.module] if node.module else []))

    # --------------------------------------------------------------- bindings
    @staticmethod
    def _statements(body):
        # Top-level statements, including those under if / try / with (not in defs).
        for node in body:
            yield node
            if isinstance(node, (ast.If, ast.For, ast.While, ast.With)):
                yield from SourceTree._statements(node.body)
                yield from SourceTree._statements(getattr(node, "orelse", []))
            elif isinstance(node, ast.Try):
                for block in (node.body, node.orelse, node.finalbody,
                              *(h.body for h in node.handlers)):
                    yield from SourceTree._statements(block)

    def _binding(self, module: str, body, name: str):
        """The last statement in `body` binding `name`: (kind, value, module)."""
        found = None
        for node in self._statements(body):
            if isinstance(node, _DEFS) and node.name == name:
                found = ("def", node, module)
            elif isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == name for t in node.targets):
                found = ("assign", node.value, module)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                    and node.target.id == name:
                found = ("assign", node.value, module)
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        found = ("import", (self._absolute(module, node), alias.name), module)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname == name:
                        found = ("module", alias.name, module)
        return found

    def _resolve_binding(self, found, depth: int = 0):
        """Follow imports and plain aliases to a def, a module or a value."""
        if depth > 20:
            raise Missing("import chain too long")
        kind, value, module = found
        if kind == "import":
            source, name = value
            if self.module_file(f"{source}.{name}") is not None:
                return ("module", f"{source}.{name}", source)
            if not self.has_package(source):
                return ("external", f"{source}.{name}", module)
            inner = self._binding(source, self.parse(source).body, name)
            if inner is None:
                raise Missing(f"`{name}` is not defined in `{source}`")
            return self._resolve_binding(inner, depth + 1)
        if kind == "assign" and isinstance(value, ast.Name):
            inner = self._binding(module, self.parse(module).body, value.id)
            if inner is not None:
                return self._resolve_binding(inner, depth + 1)
        return found

    def _member(self, cls_found, name: str, depth: int = 0):
        """`name` in a class body, or in its bases (those defined in this tree)."""
        _, cls, module = cls_found
        found = self._binding(module, cls.body, name)
        if found is not None:
            return self._resolve_binding(found)
        for base in cls.bases:
            base_found = None
            if isinstance(base, ast.Name):
                b = self._binding(module, self.parse(module).body, base.id)
                base_found = None if b is None else self._resolve_binding(b)
            elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
                b = self._binding(module, self.parse(module).body, base.value.id)
                b = None if b is None else self._resolve_binding(b)
                if b is not None and b[0] == "module":
                    inner = self._binding(b[1], self.parse(b[1]).body, base.attr)
                    base_found = None if inner is None else self._resolve_binding(inner)
            if base_found and base_found[0] == "def" \
                    and isinstance(base_found[1], ast.ClassDef) and depth < 20:
                try:
                    return self._member(base_found, name, depth + 1)
                except Missing:
                    continue
        raise Missing(f"`{cls.name}` has no `{name}`")

    def find(self, path: str):
        """Resolve "module:Qual.name" to ("def" | "assign" | "module" | "external", ...)."""
        module, _, qualname = path.partition(":")
        parts = qualname.split(".")
        found = self._binding(module, self.parse(module).body, parts[0])
        if found is None:
            raise Missing(f"`{parts[0]}` is not defined in `{module}`")
        first = found
        found = self._resolve_binding(found)
        for part in parts[1:]:
            kind, value, _ = found
            if kind == "module":
                inner = self._binding(value, self.parse(value).body, part)
                if inner is None:
                    raise Missing(f"`{part}` is not defined in `{value}`")
                found = self._resolve_binding(inner)
            elif kind == "def" and isinstance(value, ast.ClassDef):
                found = self._member(found, part)
            elif kind == "external":
                return found, first
            else:
                raise Missing(f"cannot follow `{path}` past `{part}` in the source")
        return found, first

    # ----------------------------------------------------------------- checks
    @staticmethod
    def _params(fn: ast.FunctionDef, in_class: bool) -> tuple[str, ...]:
        a = fn.args
        names = [x.arg for x in a.posonlyargs + a.args]
        if a.vararg:
            names.append(a.vararg.arg)
        names += [x.arg for x in a.kwonlyargs]
        if a.kwarg:
            names.append(a.kwarg.arg)
        decorators = {d.id for d in fn.decorator_list if isinstance(d, ast.Name)}
        if in_class and "classmethod" in decorators:
            names = names[1:]  # bound to the class: inspect drops `cls`
        return tuple(names)

    @staticmethod
    def _names(fn) -> set[str]:
        names = set()
        for node in ast.walk(fn):
            if isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, (ast.ImportFrom, ast.Import)):
                names |= {a.asname or a.name for a in node.names}
        return names

    def check_symbol(self, symbol: Symbol) -> list[str]:
        """What does not match `symbol` in this tree (empty: as in the table)."""
        try:
            (kind, value, _), first = self.find(symbol.path)
        except Missing as e:
            return [str(e)]
        problems = []
        if symbol.imported_from is not None:
            source = ":".join(first[1]) if first[0] == "import" else None
            if source != symbol.imported_from:
                problems.append(f"`{symbol.path}` is not imported from "
                                f"`{symbol.imported_from}` (from {source or 'nowhere'})")
        if symbol.params is None and not symbol.uses:
            return problems
        if kind == "external":
            return problems  # defined outside this tree: nothing to read
        if kind != "def" or isinstance(value, ast.ClassDef):
            return problems + [f"`{symbol.path}` is not a function in the source"]
        if symbol.params is not None:
            params = self._params(value, in_class="." in symbol.qualname)
            if params != symbol.params:
                problems.append(f"`{symbol.path}` has parameters {list(params)}, not "
                                f"{list(symbol.params)}")
        missing = [u for u in symbol.uses if u not in self._names(value)]
        if missing:
            problems.append(f"`{symbol.path}` no longer refers to {missing}")
        return problems

    def check_patch(self, patch: Patch) -> tuple[list[str], list[str]]:
        """(problems, skipped symbols) of one row."""
        problems, skipped = [], []
        for symbol in patch.changes + patch.checks:
            if not self.has_package(symbol.module):
                skipped.append(symbol.path)
            else:
                problems += self.check_symbol(symbol)
        return list(dict.fromkeys(problems)), skipped  # one line per missing module


def source_root(directory: str | Path) -> Path:
    """The folder holding `vllm/`, given it or `vllm/` itself."""
    directory = Path(directory)
    if (directory / "vllm" / "__init__.py").is_file():
        return directory
    if directory.name == "vllm" and (directory / "__init__.py").is_file():
        return directory.parent
    raise FileNotFoundError(f"{directory} holds no vllm/__init__.py")


def check_source(directory: str | Path) -> dict[str, tuple[list[str], list[str]]]:
    """Per row id: (problems, skipped symbols) in the vLLM source under `directory`."""
    tree = SourceTree(source_root(directory))
    return {patch.id: tree.check_patch(patch) for patch in PATCHES}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    results = check_source(argv[0])
    for patch_id, (problems, skipped) in results.items():
        print(f"{'OK  ' if not problems else 'FAIL'} {patch_id}")
        for problem in problems:
            print(f"       {problem}")
        for path in skipped:
            print(f"       skipped (not in this tree): {path}")
    failed = sum(1 for problems, _ in results.values() if problems)
    print(f"{len(results) - failed} of {len(results)} rows would apply unchanged")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
