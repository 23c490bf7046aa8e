"""vllm-dspine: the DSpine speculative drafter for vLLM 0.32.0.

Installed, it registers a `vllm.general_plugins` entry point (`vllm_dspine.plugin`)
so that `{"method": "dspine", "model": DRAFT_DIR, "num_speculative_tokens": 15}`
works in `vllm serve --speculative-config`, `LLM(speculative_config=...)` and the
async engine. See README.md and docs/.
"""

__version__ = "0.1.0"
