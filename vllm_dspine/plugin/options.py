"""DSpine's own keys of the speculative-config dict, and their checks.

`SpeculativeConfig` forbids unknown keys, so the `engine_args` patch
(`plugin/patches/engine_args.py`) takes these out with `split_dspine_options` before vLLM
builds its config. The keys are documented in docs/serving.md. No vLLM import here.
"""

from __future__ import annotations


def _verify_max_option(value):
    # bool is an int subclass: `true` is not a length.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"speculative_config['dspine_verify_max'] = {value!r} is not a number of "
            f"drafts; give an integer from 1 to 15 (the drafts of one block)")
    return value


_COST_KEYS = ("step_s", "token_s", "draft_s")


def _verify_cost_option(value):
    ok = isinstance(value, dict) and set(value) == set(_COST_KEYS) and all(
        isinstance(value[k], (int, float)) and not isinstance(value[k], bool)
        and value[k] >= 0 for k in _COST_KEYS)
    if not ok:
        raise ValueError(
            f"speculative_config['dspine_verify_cost'] = {value!r}: give "
            f'{{"step_s": a, "token_s": b, "draft_s": c}} (seconds, >= 0: a verification '
            f"step of N tokens costs a + b N, the drafter c), or leave it out to measure "
            f"the running engine")
    return {k: float(value[k]) for k in _COST_KEYS}


def _lookup_n_option(key):
    def check(value):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 16:
            raise ValueError(
                f"speculative_config['{key}'] = {value!r} is not an n-gram length; give "
                f"an integer from 1 to 16 (the suffix length the prompt lookup matches)")
        return value
    return check


def _lookup_corpus_option(value):
    if value is True or value is False or (isinstance(value, str) and value):
        return value
    raise ValueError(
        f"speculative_config['dspine_lookup_corpus'] = {value!r}: give true (the drafter "
        f"folder's lookup_corpus.npz), the path of a lookup corpus, or false (the "
        f"default: no corpus lookup)")


# A value is the tuple of allowed values or a function that checks (and normalises) one.
DSPINE_OPTIONS = {
    "dspine_retrieval": ("auto", "fp8", "bf16"),
    "dspine_draft_gemm": ("auto", "fp32", "bf16"),
    "dspine_tail": (True, False),
    "dspine_verify": ("dynamic", "fixed"),
    "dspine_verify_max": _verify_max_option,
    "dspine_verify_cost": _verify_cost_option,
    "dspine_verify_objective": ("throughput", "fair"),
    "dspine_lookup": (True, False),
    "dspine_lookup_min": _lookup_n_option("dspine_lookup_min"),
    "dspine_lookup_max": _lookup_n_option("dspine_lookup_max"),
    "dspine_lookup_corpus": _lookup_corpus_option,
}


def split_dspine_options(spec: dict) -> tuple[dict, dict]:
    """Validate a `method: dspine` dict; return (dict for vLLM, DSpine options)."""
    spec = dict(spec)
    options = {}
    for key, allowed in DSPINE_OPTIONS.items():
        if key in spec:
            value = spec.pop(key)
            if callable(allowed):
                value = allowed(value)
            # By type too: 1 == True, but 1 is not a boolean setting.
            elif not any(value == a and type(value) is type(a) for a in allowed):
                raise ValueError(
                    f"speculative_config['{key}'] = {value!r} is not one of {allowed}")
            options[key] = value
    lo, hi = options.get("dspine_lookup_min", 2), options.get("dspine_lookup_max", 4)
    if lo > hi:
        raise ValueError(
            f"speculative_config['dspine_lookup_min'] = {lo} is above "
            f"'dspine_lookup_max' = {hi}; give min <= max (defaults 2 and 4)")
    if not spec.get("model"):
        raise ValueError(
            "speculative_config with method 'dspine' needs 'model': the DSpine draft "
            "folder (config.json + *.safetensors)")
    if spec.get("draft_sample_method") not in (None, "greedy"):
        raise ValueError(
            "speculative_config['draft_sample_method'] is not used by DSpine: sampled "
            "requests always draw their drafts from DSpine's own 16-candidate chain and "
            "are verified against that sparse q; remove the key")
    if spec.get("rejection_sample_method") not in (None, "standard"):
        raise ValueError(
            f"speculative_config['rejection_sample_method'] = "
            f"{spec['rejection_sample_method']!r} is not supported with DSpine (only "
            f"exact 'standard' verification); remove the key")
    spec["method"] = "dflash"
    return spec, options
