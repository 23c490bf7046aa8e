"""The verification-length settings in the speculative config: accepted, resolved, or
refused with a message naming the setting and the fix. No engine is started (vLLM
builds its configs in `EngineArgs.create_engine_config`, where the checks run)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine_utils import engine_env


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    engine_env()
    from vllm_dspine.pairs.tiny import write_tiny_pair

    return write_tiny_pair(str(tmp_path_factory.mktemp("pair")), seed=0)


def _build(pair, spec_extra=None, **engine_kwargs):
    from vllm.engine.arg_utils import EngineArgs

    spec = {"method": "dspine", "model": pair.draft_dir, "num_speculative_tokens": 15}
    spec.update(spec_extra or {})
    args = EngineArgs(model=pair.target_dir, dtype="float32", speculative_config=spec,
                      **engine_kwargs)
    return args, args.create_engine_config()


def _options(config) -> dict:
    return config.speculative_config.draft_model_config.hf_config.dspine_options


def test_dynamic_is_the_default_and_turns_async_scheduling_off(pair):
    args, config = _build(pair)
    assert _options(config)["dspine_verify"] == "dynamic"
    assert args.async_scheduling is False
    assert config.scheduler_config.async_scheduling is False


def test_fixed_with_a_cap_and_an_injected_cost_are_accepted(pair):
    cost = {"step_s": 0.01, "token_s": 0.0005, "draft_s": 0}
    _, config = _build(pair, {"dspine_verify": "fixed", "dspine_verify_max": 6})
    assert _options(config) == {"dspine_verify": "fixed", "dspine_verify_max": 6}
    _, config = _build(pair, {"dspine_verify_cost": cost})
    assert _options(config)["dspine_verify_cost"] == {"step_s": 0.01, "token_s": 0.0005,
                                                       "draft_s": 0.0}


def test_lookup_is_accepted_with_its_lengths(pair):
    """`dspine_lookup` (docs/lookup.md) with the dynamic policy, its n-gram lengths."""
    _, config = _build(pair, {"dspine_lookup": True, "dspine_lookup_min": 1,
                              "dspine_lookup_max": 3})
    o = _options(config)
    assert (o["dspine_lookup"], o["dspine_lookup_min"], o["dspine_lookup_max"]) == (True, 1, 3)
    assert o["dspine_verify"] == "dynamic"


def test_verify_objective_is_accepted(pair):
    """`dspine_verify_objective` (docs/dynamic-verification.md, "Objective"): kept in
    the drafter's options for the proposer."""
    _, config = _build(pair, {"dspine_verify_objective": "throughput", "dspine_lookup": True})
    assert _options(config)["dspine_verify_objective"] == "throughput"


def test_dynamic_defaults_to_the_lookup_and_the_fair_objective(pair):
    """Without the keys, dynamic verification (the default) takes the prompt lookup and
    the fair objective (docs/serving.md); each can be turned off alone; with 'fixed'
    neither is set (neither applies) and giving either is refused (below)."""
    _, config = _build(pair)
    o = _options(config)
    assert (o["dspine_verify"], o["dspine_lookup"], o["dspine_verify_objective"]) == (
        "dynamic", True, "fair")
    _, config = _build(pair, {"dspine_lookup": False})
    o = _options(config)
    assert (o["dspine_lookup"], o["dspine_verify_objective"]) == (False, "fair")
    _, config = _build(pair, {"dspine_verify": "fixed"})
    assert _options(config) == {"dspine_verify": "fixed"}


def test_batch_size_schedule_is_accepted(pair):
    """vLLM's `num_speculative_tokens_per_batch_size` is supported: the block is still
    drafted whole, verification takes the schedule's count (tests/test_dynamic_engine.py
    checks it is exact)."""
    _, config = _build(pair, {"num_speculative_tokens_per_batch_size": [[1, 2, 15],
                                                                         [3, 64, 4]]})
    assert config.speculative_config.num_speculative_tokens_per_batch_size
    assert config.speculative_config.num_speculative_tokens == 15


@pytest.mark.parametrize("extra, match", [
    pytest.param({"dspine_verify": "sometimes"}, r"dspine_verify'\] = 'sometimes'",
                 id="unknown-mode"),
    pytest.param({"dspine_verify_max": 16}, r"dspine_verify_max'\] = 16.*give 1 to 15",
                 id="cap-above-block"),
    pytest.param({"dspine_verify_max": 0}, r"dspine_verify_max'\] = 0.*from 1 to 15",
                 id="cap-zero"),
    pytest.param({"dspine_verify_max": True}, r"dspine_verify_max'\] = True", id="cap-bool"),
    pytest.param({"dspine_verify_cost": {"step_s": 1.0}}, r"dspine_verify_cost.*step_s",
                 id="cost-incomplete"),
    pytest.param({"dspine_verify_cost": {"step_s": 1, "token_s": -1, "draft_s": 0}},
                 r"dspine_verify_cost", id="cost-negative"),
    pytest.param({"num_speculative_tokens_per_batch_size": [[2, 8, 3]]},
                 r"num_speculative_tokens_per_batch_size'\] = .*start at 1",
                 id="schedule-not-from-1"),
    pytest.param({"dspine_lookup": "yes"}, r"dspine_lookup'\] = 'yes'", id="lookup-not-bool"),
    pytest.param({"dspine_lookup_min": 0}, r"dspine_lookup_min'\] = 0.*from 1 to 16",
                 id="lookup-min-zero"),
    pytest.param({"dspine_lookup_min": 5, "dspine_lookup_max": 3},
                 r"dspine_lookup_min'\] = 5 is above", id="lookup-min-above-max"),
    pytest.param({"dspine_verify_objective": "latency"},
                 r"dspine_verify_objective'\] = 'latency' is not one of", id="objective-unknown"),
    pytest.param({"dspine_verify_objective": "fair", "dspine_verify": "fixed"},
                 r"dspine_verify_objective'\] = 'fair' needs dspine_verify 'dynamic'",
                 id="objective-with-fixed"),
    pytest.param({"dspine_lookup": True, "dspine_verify": "fixed"},
                 r"dspine_lookup'\] = true needs dspine_verify 'dynamic'",
                 id="lookup-with-fixed"),
    pytest.param({"dspine_lookup": 1}, r"dspine_lookup'\] = 1 is not one of",
                 id="lookup-int-for-bool"),
    pytest.param({"dspine_lookup_corpus": True, "dspine_lookup": False},
                 r"dspine_lookup_corpus'\] = True needs the lookup on", id="corpus-without-lookup"),
    pytest.param({"dspine_lookup_corpus": "/x.npz", "dspine_verify": "fixed"},
                 r"dspine_lookup_corpus'\] = '/x.npz' needs the lookup on", id="corpus-with-fixed"),
    pytest.param({"dspine_lookup_corpus": ""}, r"dspine_lookup_corpus'\] = ''",
                 id="corpus-empty-path"),
    pytest.param({"dspine_lookup_corpus": "/no/such/corpus.npz"},
                 r"dspine_lookup_corpus'\] = '/no/such/corpus.npz': no lookup corpus at "
                 r"/no/such/corpus.npz; write one with `python -m vllm_dspine.train.lookup_corpus",
                 id="corpus-missing-file"),
    pytest.param({"dspine_lookup_corpus": True},
                 r"dspine_lookup_corpus'\] = True: no lookup corpus at .*lookup_corpus.npz",
                 id="corpus-true-without-the-drafters-file"),
])
def test_bad_settings_are_refused(pair, extra, match):
    with pytest.raises(ValueError, match=match):
        _build(pair, extra)


@pytest.mark.parametrize("extra", [{}, {"dspine_verify_max": 8}])
def test_async_scheduling_asked_for_is_refused_with_shortened_verification(pair, extra):
    with pytest.raises(ValueError, match=r"async_scheduling=True.*dspine_verify 'fixed'"):
        _build(pair, extra, async_scheduling=True)


def test_hybrid_target_verifies_all_drafts():
    """A hybrid (recurrent-state) target that DSpine's replay commit does not serve (no
    Qwen3.5 / Qwen3-Next GDN architecture; such targets are refused at start anyway):
    vLLM's CPU GDN path is wrong when a step verifies fewer drafts than K (docs/measured.md),
    so the default becomes 'fixed' and asking for fewer is refused. GDN hybrids take
    every setting (tests/test_hybrid_pair_offline.py, tests/test_hybrid_engine.py)."""
    from vllm_dspine.config import DSpineConfig
    from vllm_dspine.pairs.tiny import draft_config
    from vllm_dspine.proposer.validation import check_verification_options

    cfg = draft_config((1, 3, 4), None)
    assert isinstance(cfg, DSpineConfig)
    spec = SimpleNamespace(num_speculative_tokens_per_batch_size=None,
                           target_model_config=SimpleNamespace(is_hybrid=True,
                                                               has_inner_state=True))
    assert check_verification_options(spec, cfg, {})["dspine_verify"] == "fixed"
    for opts in ({"dspine_verify": "dynamic"}, {"dspine_verify_max": 4}):
        with pytest.raises(ValueError, match=r"hybrid.*Remove the setting"):
            check_verification_options(spec, cfg, opts)
    spec.num_speculative_tokens_per_batch_size = [[1, 8, 3]]
    with pytest.raises(ValueError, match=r"num_speculative_tokens_per_batch_size.*hybrid"):
        check_verification_options(spec, cfg, {})


def test_a_lookup_corpus_that_is_not_one_is_refused_at_start(pair, tmp_path):
    """A file that exists but holds no lookup corpus is named at start (front end),
    with the command that writes one; a real one is accepted and kept in the options."""
    import numpy as np

    from vllm_dspine.model.lookup_corpus import write_lookup_corpus

    bad = tmp_path / "bad.npz"
    np.savez(bad, tokens=np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match=r"bad.npz is not a DSpine lookup corpus.*lookup_corpus"):
        _build(pair, {"dspine_lookup_corpus": str(bad)})
    good = str(tmp_path / "good.npz")
    write_lookup_corpus([np.array([1, 2, 3])], good)
    _, config = _build(pair, {"dspine_lookup_corpus": good})
    assert _options(config)["dspine_lookup_corpus"] == good
