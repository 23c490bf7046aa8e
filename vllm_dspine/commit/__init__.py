"""Commit: what becomes history after verification (DESIGN section 1.7).

For dense targets vLLM itself commits the accepted prefix: the target KV of rejected
positions is overwritten by later steps, and the draft context K/V is written only for
committed positions (`proposer/dspine_proposer.py`). The replay commit of hybrid Gated
DeltaNet state through the accepted prefix will live in this folder; until it does,
hybrid targets do not run under `dspine` (docs/architecture.md).
"""
