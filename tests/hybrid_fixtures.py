"""What the hybrid-pair test modules share (tests/test_hybrid_*.py): the autouse fixture
that keeps transformers off the model hub, and the engine settings and helpers of the
engine modules (their engines come from the session's registry, conftest.py). Import the
fixture into a module (`from hybrid_fixtures import offline`) for it to apply there. The
trained hybrid pair is the session fixture `hybrid_trained_pair` of conftest.py (the
committed distilled drafter, tests/trained_drafters.py, for tests/test_hybrid_engine.py
and tests/test_hybrid_sampled.py)."""

from __future__ import annotations

import importlib

import pytest

# bf16: the only dtype vLLM's CPU GDN path runs.
ENGINE_KW = dict(dtype="bfloat16", enable_prefix_caching=False, max_num_seqs=16)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def qwen3_5_importable() -> bool:
    """vLLM's Qwen3.5 module imports its vision sibling, which needs torchvision (absent
    here); the plugin's patches must make the text model importable without it."""
    from vllm_dspine.plugin import register

    register()
    try:
        importlib.import_module("vllm.model_executor.models.qwen3_5")
    except ImportError:
        return False
    return True


def engine_kw(**kw) -> dict:
    """ENGINE_KW overridden by `kw`: the arguments of a hybrid engine from the session's
    registry (`engines.get(target, spec, **engine_kw(...))`, conftest.py)."""
    return {**ENGINE_KW, **kw}


def engine_metric(llm, name: str):
    """vLLM's metric object `name` of an engine in this process (`LLM.get_metrics()`)."""
    for m in llm.get_metrics():
        if m.name == name:
            return m
    raise KeyError(f"vLLM exposes no metric {name!r}")
