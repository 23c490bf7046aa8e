"""Commit: what becomes history after verification (docs/design.md section 1.7).

For dense targets vLLM itself commits the accepted prefix: the target KV of rejected
positions is overwritten by later steps, and the draft context K/V is written only for
committed positions (`proposer/dspine_proposer.py`).

For hybrid Gated DeltaNet (GDN) targets (Qwen3.5 / Qwen3-Next text) this folder holds the
replay commit: each request keeps one state slot (its checkpoint: recurrent state and
conv window before the verified block) plus the block's per-position inputs (pre-conv
`mixed_qkv` and the gate inputs `a`, `b`); after verification `gdn_replay` rebuilds the
slot through exactly the accepted prefix, in place:

- `gdn_ref.py`: the GDN recurrence as vLLM 0.32.0 runs it, in plain PyTorch (the formula,
  per token, float64-capable) and `replay_commit_ref` (the CPU path);
- `replay.py`: the Triton kernels (`gdn_replay_kernel`, `gdn_conv_window_kernel`), their
  launcher `gdn_replay_fwd` and the public, validating `gdn_replay`;
- `runner.py`: the integration into vLLM's runner, CPU path (the verify forward that
  keeps the checkpoint and records the inputs; the commit after sampling), called by
  the `gdn-*` rows of `plugin/patches/table.py` (`plugin/patches/gdn_commit.py`). The CUDA verify forward is planned
  in docs/hybrid.md and not wired: hybrid targets are refused under `dspine` on CUDA.
"""

from vllm_dspine.commit.gdn_ref import GDNWeights, VerifiedBlockInputs, replay_commit_ref
from vllm_dspine.commit.replay import gdn_replay

__all__ = ["GDNWeights", "VerifiedBlockInputs", "gdn_replay", "replay_commit_ref"]
