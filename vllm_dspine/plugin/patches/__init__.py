"""Every change vllm-dspine makes to vLLM 0.32.0, as one table.

- `table.py`: the rows (`Patch`): id, the vLLM symbols a patch changes and those it
  relies on (each with the parameters and names the pinned version has), when it is
  installed, whom it acts on, why it exists, how it works and what upstream change
  retires it. README.md in this folder is the index rendered from it by `readme.py`
  (the Why / How / When-it-can-go list); tests/test_vllm_patches.py fails when the two
  differ.
- `apply.py`: `apply_patches()`, run by the plugin's `register()` in every vLLM process
  (never on import): the pinned-version check, then each row whose condition holds,
  its symbols checked in the running vLLM before its function changes anything.
- One module per vLLM area holds the apply functions: `engine_args.py` (front end),
  `model_runner.py`, `kv_cache.py` (KV cache groups; the choice in
  `vllm_dspine/model/kv_cache_groups.py`), `cpu_kernels.py` (CPU platform and ops; the maths in
  `vllm_dspine/kernels/cpu_replacements.py`), `metrics.py`, `import_hooks.py`,
  `gdn_commit.py` (hybrid Gated DeltaNet targets), `profiling.py` (bench/e2e.py).
- `guard.py`: the pinned version and the one mark of an applied patch
  (`_dspine_patch_ids` on what the patch installed); every apply function is a no-op
  the second time.
- `check_source.py`: the same rows checked statically against another vLLM's source
  (`python -m vllm_dspine.plugin.patches.check_source DIR`, docs/compatibility.md).
"""

from vllm_dspine.plugin.patches.apply import apply_patch, apply_patches
from vllm_dspine.plugin.patches.guard import (
    PINNED_VLLM_VERSION,
    check_vllm_version,
    installed_vllm_version,
    is_applied,
)
from vllm_dspine.plugin.patches.table import PATCHES

__all__ = ["PATCHES", "PINNED_VLLM_VERSION", "apply_patch", "apply_patches",
           "check_vllm_version", "installed_vllm_version", "is_applied"]
