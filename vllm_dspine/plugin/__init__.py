"""The `vllm.general_plugins` entry point (pyproject.toml): vLLM calls `register()` in
every process it starts (front end, engine core, workers) before it builds configs or
models. Importing this module changes nothing; `register()` does the work, once."""

from __future__ import annotations

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm import ModelRegistry

    from vllm_dspine.cpu_env import has_cuda_gpu, respect_cpu_affinity
    from vllm_dspine.hf_config import register_hf_config
    from vllm_dspine.plugin.patches import apply_patches

    if not has_cuda_gpu():
        respect_cpu_affinity()  # before the engine core spawns its pinned workers
    apply_patches()
    register_hf_config()
    model = "vllm_dspine.model.vllm_model:DSpineDraftForCausalLM"
    # vLLM's DFlash path renames a draft architecture X to "DFlashX".
    for arch in ("DSpineDraftModel", "DFlashDSpineDraftModel"):
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, model)
    _registered = True


def is_registered() -> bool:
    """Whether `register()` has run in this process."""
    return _registered
