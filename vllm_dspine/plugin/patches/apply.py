"""Walking the table: `apply_patches()` checks the vLLM version, then for each row of
`table.PATCHES` whose condition holds checks its symbols in the running vLLM and calls
its apply function (each safe to call twice: `guard.is_applied`)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from pathlib import Path

from vllm_dspine.plugin.patches.guard import (
    PINNED_VLLM_VERSION,
    check_vllm_version,
    installed_vllm_version,
)
from vllm_dspine.plugin.patches.table import BY_ID, PATCHES, Patch, Symbol


def installs(patch: Patch) -> bool:
    """Whether `patch.when` holds in this process (table.WHEN)."""
    if patch.when == "always":
        return True
    if patch.when == "cpu":
        from vllm.platforms import current_platform

        return current_platform.is_cpu()
    if patch.when == "no-torchvision":
        return importlib.util.find_spec("torchvision") is None
    if patch.when == "step-profile":
        from vllm_dspine.step_profile import profile

        return profile() is not None
    raise AssertionError(patch.when)


def _code_names(code) -> set[str]:
    # co_names of a function and of the code nested in it (comprehensions, closures).
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _code_names(const)
    return names


def _class_field(cls, name: str) -> bool:
    # A dataclass field without a default is no class attribute.
    return any(name in getattr(k, "__dataclass_fields__", {})
               or name in getattr(k, "__annotations__", {}) for k in cls.__mro__)


def check_symbol(symbol: Symbol) -> list[str]:
    """What does not match `symbol` in the running vLLM (empty: all as in the table).
    A patched symbol checks as the original it wraps."""
    if symbol.read_source:
        from vllm_dspine.plugin.patches.check_source import SourceTree

        top = symbol.module.split(".")[0]
        spec = importlib.util.find_spec(top)
        if spec is None or not spec.submodule_search_locations:
            return [f"package `{top}` is not installed"]
        return SourceTree(Path(list(spec.submodule_search_locations)[0]).parent) \
            .check_symbol(symbol)
    try:
        obj = importlib.import_module(symbol.module)
    except ImportError as e:
        return [f"module `{symbol.module}` does not import ({e})"]
    parts = symbol.qualname.split(".")
    for i, part in enumerate(parts):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif i == len(parts) - 1 and inspect.isclass(obj) and _class_field(obj, part):
            return []  # a field: nothing more to check
        else:
            return [f"`{symbol.path}` is missing (no `{part}`)"]
    problems = []
    # Our wrappers carry `__wrapped__` (functools.wraps): check the original. A wrapped
    # classmethod unwraps to the original bound method, whose signature omits `cls`.
    obj = inspect.unwrap(obj)
    if symbol.params is not None:
        params = tuple(inspect.signature(obj).parameters)
        if params != symbol.params:
            problems.append(f"`{symbol.path}` has parameters {list(params)}, not "
                            f"{list(symbol.params)}")
    if symbol.uses:
        code = getattr(obj, "__code__", None)
        names = set() if code is None else _code_names(code)
        missing = [u for u in symbol.uses if u not in names]
        if missing:
            problems.append(f"`{symbol.path}` no longer refers to {missing}")
    return problems


def check_patch(patch: Patch) -> list[str]:
    """Every symbol of one row checked in the running vLLM."""
    return [p for s in patch.changes + patch.checks for p in check_symbol(s)]


def apply_patch(patch: Patch | str) -> bool:
    """Check and apply one row (by row or id); False when its condition does not hold.
    Safe to call twice."""
    patch = BY_ID[patch] if isinstance(patch, str) else patch
    if not installs(patch):
        return False
    problems = check_patch(patch)
    if problems:
        raise RuntimeError(
            f"vllm-dspine cannot apply patch `{patch.id}` (vllm_dspine/plugin/patches/"
            f"README.md) in vLLM {installed_vllm_version()} (pinned: "
            f"{PINNED_VLLM_VERSION}): " + "; ".join(problems))
    module, _, function = patch.apply.partition(":")
    apply = getattr(importlib.import_module(f"vllm_dspine.plugin.patches.{module}"), function)
    apply()
    return True


def apply_patches() -> None:
    """Apply every row of the table whose condition holds, in order (idempotent). Run
    at plugin registration, in every vLLM process; refuses any vLLM but the pinned."""
    check_vllm_version()
    for patch in PATCHES:
        apply_patch(patch)
