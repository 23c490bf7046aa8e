"""The real small pair: `python -m vllm_dspine.pairs smollm2 --out DIR` writes SmolLM2 and
the committed drafter; through vLLM the drafter is exact (greedy = plain) and works
(its drafts are accepted: a broken integration, e.g. wrong feature layers or a
drafter that does not fit the target, gives almost none)."""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch

from vllm_dspine.model.checkpoint import load_draft_checkpoint
from vllm_dspine.pairs.smollm2 import COMMITTED_DRAFTER, default_cache_dir

CODE_PROMPTS = (
    "Write a Python function that returns the sum of the squares of a list of numbers.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that returns the largest element of a list.",
    "Write a Python function that counts the words in a sentence.",
)


@pytest.fixture(scope="module")
def pair(smollm2_pair):
    return smollm2_pair  # conftest.py: `python -m vllm_dspine.pairs smollm2`, once


def test_committed_drafter_is_small_bf16_with_its_record(tmp_path):
    """The drafter is committed packed (model/packed.py: the codebook rows training
    touched); unpacked it is a bf16 checkpoint whose kept rows are the packed ones and
    whose other codebook rows are zero."""
    from safetensors.torch import load_file

    from vllm_dspine.model.packed import PACKED, unpack_drafter

    size = os.path.getsize(os.path.join(COMMITTED_DRAFTER, PACKED))
    # The tracked tree stays under 60 MB (a GPU machine takes at most 64 MiB with the
    # working tree): 40 MiB of drafter leave ~18 MB for the rest (~12 MB on 2026-12-04).
    assert size <= 40 * 2**20, f"committed drafter is {size / 2**20:.1f} MiB (> 40 MiB)"
    assert not [f for f in os.listdir(COMMITTED_DRAFTER) if f.endswith(".safetensors")]
    cfg, tensors = load_draft_checkpoint(unpack_drafter(COMMITTED_DRAFTER,
                                                        str(tmp_path / "draft")))
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    packed = load_file(os.path.join(COMMITTED_DRAFTER, PACKED))
    ids = packed["bridge.codebook_row_ids"].long()
    assert torch.equal(tensors["bridge.codebook"][ids], packed["bridge.codebook_rows"])
    others = torch.ones(cfg.vocab_size, dtype=torch.bool)
    others[ids] = False
    assert not tensors["bridge.codebook"][others].any()
    for name, t in packed.items():
        if not name.startswith("bridge.codebook_row"):
            assert torch.equal(tensors[name], t), name
    from vllm_dspine.train.__main__ import record_stages

    with open(os.path.join(COMMITTED_DRAFTER, "training.json")) as f:
        stages = record_stages(json.load(f))
    assert stages
    for stage in stages:  # every stage of its history, each with what made it
        for key in ("command", "steps", "loss_last50", "held_out"):
            assert key in stage, key
        assert stage["loss_last50"] < stage["loss_first"]  # it trained


def test_pair_fits_and_is_reused(pair, capsys):
    from vllm_dspine.pairs.__main__ import main

    cfg, _ = load_draft_checkpoint(str(pair / "draft"))
    with open(pair / "target" / "config.json") as f:
        t = json.load(f)
    cfg.check_target(hidden_size=t["hidden_size"], vocab_size=t["vocab_size"],
                     num_layers=t["num_hidden_layers"], where="smollm2 target")
    stamp = (pair / "target" / "model.safetensors").stat().st_mtime_ns
    assert main(["smollm2", "--out", str(pair), "--cache", default_cache_dir()]) == 0
    assert "reused" in capsys.readouterr().out
    assert (pair / "target" / "model.safetensors").stat().st_mtime_ns == stamp


ENGINE_KW = dict(max_model_len=1024, max_num_seqs=4)
# Tokens per answer: each of the module's two engines decodes the four answers (plain
# SmolLM2 ~7 tokens/s on a slow core).
MAX_TOKENS = 64


def _code_chat(llm):
    from vllm import SamplingParams

    msgs = [[{"role": "user", "content": p}] for p in CODE_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return [list(o.outputs[0].token_ids) for o in llm.chat(msgs, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain_code_outputs(engines, pair):
    """Plain vLLM's greedy answers to CODE_PROMPTS (an engine of its own, then shut down)."""
    with engines.private(str(pair / "target"), None, **ENGINE_KW) as plain:
        return _code_chat(plain)


@pytest.mark.engine
def test_dspine_on_smollm2_is_exact_and_accepts(engines, pair, plain_code_outputs):
    from engine_utils import dspine_spec
    from vllm_dspine.serving.metrics import spec_decode_counters

    want = plain_code_outputs
    kw = ENGINE_KW
    with engines.private(str(pair / "target"), dspine_spec(str(pair / "draft")), **kw) as llm:
        got = _code_chat(llm)
        m = spec_decode_counters(llm)
    assert got == want
    drafts = m["vllm:spec_decode_num_drafts"]
    tau = 1 + m["vllm:spec_decode_num_accepted_tokens"] / drafts
    print(f"SmolLM2: mean acceptance length {tau:.2f} over {drafts} verifications, "
          f"{sum(map(len, got))} tokens")
    # A random drafter of this shape gets ~0.02 drafts accepted per step; the trained
    # one gets well over one on code (docs/smollm2-drafter.md). 1.5 leaves room for the
    # prompts here while failing on any integration that feeds the drafter wrong inputs.
    assert tau >= 1.5, f"mean acceptance length {tau:.2f}"


# Full tier: its own engine (~66 s on one core). The test above runs DSpine's defaults,
# the prompt lookup included (docs/lookup.md, "Default"); this one the drafter alone.
@pytest.mark.full
@pytest.mark.engine
def test_dspine_without_lookup_on_smollm2_is_exact(engines, pair, plain_code_outputs):
    """`dspine_lookup` off: greedy output identical to plain decoding, the drafter's
    drafts accepted."""
    from engine_utils import dspine_spec
    from vllm_dspine.serving.metrics import spec_decode_counters

    with engines.private(str(pair / "target"),
                         dspine_spec(str(pair / "draft"), dspine_lookup=False),
                         **ENGINE_KW) as llm:
        got = _code_chat(llm)
        m = spec_decode_counters(llm)
    assert got == plain_code_outputs
    drafts = m["vllm:spec_decode_num_drafts"]
    tau = 1 + m["vllm:spec_decode_num_accepted_tokens"] / drafts
    print(f"SmolLM2 without lookup: mean acceptance length {tau:.2f} over {drafts} "
          f"verifications")
    assert tau >= 1.5, f"mean acceptance length {tau:.2f}"


def test_a_benchmark_never_measures_a_stale_drafter(smollm2_pair, tmp_path, monkeypatch):
    """bench/lib/pair.py: a SmolLM2 pair folder made before the committed drafter changed
    (its record holds another digest; the case of artifacts/smollm2 holding the 2026-12-01
    drafter while the benchmarks' docs named stage 3) is brought up to date before a
    benchmark reads it; a folder without the pairs command's record is left as it is."""
    import json

    from bench.lib.pair import drafter_summary, ensure_pair
    from vllm_dspine.pairs.__main__ import RECORD
    from vllm_dspine.pairs.smollm2 import committed_drafter_digest, default_cache_dir

    monkeypatch.setenv("DSPINE_CACHE", default_cache_dir())
    stale = tmp_path / "stale"
    (stale / "target").mkdir(parents=True)
    for f in (smollm2_pair / "target").iterdir():  # hard links: no second 540 MB
        os.link(f, stale / "target" / f.name)
    (stale / "draft").mkdir()
    (stale / "draft" / "training.json").write_text('{"steps": 1200}')
    record = json.loads((smollm2_pair / RECORD).read_text())
    (stale / RECORD).write_text(json.dumps({**record, "drafters_sha256": "0" * 64}))
    assert ensure_pair(str(stale)) == str(stale)
    fresh = json.loads((stale / RECORD).read_text())
    assert fresh["drafters_sha256"] == committed_drafter_digest()
    assert ((stale / "draft" / "training.json").read_text()
            == (pathlib.Path(COMMITTED_DRAFTER) / "training.json").read_text())
    assert "training stage(s)" in drafter_summary(str(stale / "draft"))

    own = tmp_path / "own"  # a user's own folder: no record, nothing touched
    (own / "draft").mkdir(parents=True)
    (own / "draft" / "training.json").write_text('{"steps": 5}')
    ensure_pair(str(own))
    assert (own / "draft" / "training.json").read_text() == '{"steps": 5}'
