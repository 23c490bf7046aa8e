"""Shared helpers for tests that start vLLM engines (slow: ~25 s each on 2 cores)."""

from __future__ import annotations


DSPINE_K = 15


def engine_env() -> None:
    # What scripts/env.sh sets for the README's commands; tests may run without it.
    from vllm_dspine.plugin.cpu_env import set_cpu_defaults

    set_cpu_defaults()


def dspine_spec(draft_dir: str, **extra) -> dict:
    return {"method": "dspine", "model": str(draft_dir),
            "num_speculative_tokens": DSPINE_K, **extra}


def make_llm(target_dir: str, spec: dict | None = None, **kwargs):
    engine_env()
    from vllm import LLM

    # A 2048-token step budget: 50+ prompts of up to ~400 tokens cannot all prefill in
    # one step, so prefills are chunked and arrive while other requests decode, and
    # 48 decoding requests x 16 verified positions still fit in one step.
    args = dict(dtype="float32", max_model_len=512, enforce_eager=True, max_num_seqs=48,
                max_num_batched_tokens=2048, seed=0, gpu_memory_utilization=0.15,
                disable_log_stats=False)
    args.update(kwargs)
    return LLM(str(target_dir), speculative_config=spec, **args)


def spec_metrics(llm) -> dict:
    """vLLM's own spec-decode counters: name -> value (per-position ones as lists)."""
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            out[m.name] = getattr(m, "values", None) or getattr(m, "value", None)
    return out


def prompts_of_lengths(n: int, longest: int = 400) -> list[str]:
    """n prompts of 3..longest characters (one token per character), many sharing
    prefixes (so the prefix cache is hit)."""
    base = ("the quick brown fox jumps over the lazy dog while five wizards box "
            "jackdaws quickly and the sphinx of black quartz judges my vow ") * 8
    return [base[(7 * i) % 40: (7 * i) % 40 + 3 + (97 * i) % (longest - 3)]
            for i in range(n)]


HOST = "127.0.0.1"  # servers in tests listen on loopback only


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def sse_payloads(response):
    """The JSON payloads of an OpenAI-style server-sent-event stream, in order; raises
    AssertionError if the stream ends without its `data: [DONE]` line."""
    import json

    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return
        yield json.loads(line[6:])
    raise AssertionError("stream ended without 'data: [DONE]'")
