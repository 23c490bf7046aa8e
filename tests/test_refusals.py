"""Settings DSpine does not support are refused at start, in the front end, with a
message naming the setting and the fix (docs/design.md section 3). No engine is started: vLLM
builds its configs in `EngineArgs.create_engine_config`, where our checks run."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from engine_utils import engine_env


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    engine_env()
    from vllm_dspine.pairs.tiny import write_tiny_pair

    return write_tiny_pair(str(tmp_path_factory.mktemp("pair")), seed=0)


def _variant(pair, tmp_path, edit) -> str:
    """A copy of the draft folder whose config.json `edit` changes."""
    d = str(tmp_path / "draft")
    shutil.copytree(pair.draft_dir, d)
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    edit(cfg)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def _build(target, draft, *, spec_extra=None, **engine_kwargs):
    from vllm.engine.arg_utils import EngineArgs

    spec = {"method": "dspine", "model": draft, "num_speculative_tokens": 15}
    spec.update(spec_extra or {})
    args = dict(model=target, dtype="float32", speculative_config=spec)
    args.update(engine_kwargs)
    return EngineArgs(**args).create_engine_config()


def test_valid_pair_is_accepted_and_runs_on_dflash_plumbing(pair):
    config = _build(pair.target_dir, pair.draft_dir)
    spec = config.speculative_config
    assert spec.method == "dflash" and spec.num_speculative_tokens == 15
    assert spec.draft_model_config.hf_config.dspine_config["block_size"] == 16


@pytest.mark.parametrize("kwargs, match", [
    pytest.param(dict(spec_extra={"num_speculative_tokens": 7}),
                 r"num_speculative_tokens'\] = 7.*set num_speculative_tokens to 15",
                 id="wrong-num-speculative-tokens"),
    pytest.param(dict(tensor_parallel_size=2), r"tensor_parallel_size = 2.*1",
                 id="tensor-parallel"),
    pytest.param(dict(pipeline_parallel_size=2), r"pipeline_parallel_size = 2",
                 id="pipeline-parallel"),
    pytest.param(dict(quantization="fp8"), r"quantization 'fp8'.*unquantized",
                 id="quantized-output-head"),
    pytest.param(dict(dtype="float16"), r"dtype torch.float16 .*bfloat16",
                 id="unsupported-dtype"),
    pytest.param(dict(spec_extra={"dspine_retrieval": "int4"}), r"dspine_retrieval.*int4",
                 id="unknown-retrieval-mode"),
    pytest.param(dict(spec_extra={"dspine_draft_gemm": "fp16"}), r"dspine_draft_gemm.*fp16",
                 id="unknown-draft-gemm"),
    pytest.param(dict(spec_extra={"draft_sample_method": "probabilistic"}),
                 r"draft_sample_method", id="draft-sample-method"),
    pytest.param(dict(spec_extra={"rejection_sample_method": "synthetic"}),
                 r"rejection_sample_method.*synthetic", id="synthetic-rejection"),
])
def test_unsupported_settings_are_refused(pair, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _build(pair.target_dir, pair.draft_dir, **kwargs)


@pytest.mark.parametrize("edit, match", [
    pytest.param(lambda c: c["dspine_config"].update(target_layer_ids=[1, 3, 9]),
                 r"6 decoder layers.*target_layer_ids' lists \[9\]", id="missing-target-layer"),
    pytest.param(lambda c: c.update(vocab_size=1024),
                 r"vocabulary size 512 does not match.*1024", id="vocab-mismatch"),
    pytest.param(lambda c: c.update(hidden_size=256),
                 r"hidden size 128 does not match.*256", id="hidden-size-mismatch"),
    pytest.param(lambda c: c["dspine_config"].pop("code_dim"),
                 r"missing field 'code_dim'", id="config-field-missing"),
])
def test_draft_that_does_not_fit_the_target_is_refused(pair, tmp_path, edit, match):
    with pytest.raises(ValueError, match=match):
        _build(pair.target_dir, _variant(pair, tmp_path, edit))


def test_non_dspine_folder_is_refused(pair, tmp_path):
    def to_dflash(c):
        c.update(architectures=["DFlashDraftModel"], model_type="qwen3")
        c["dflash_config"] = {"mask_token_id": 257, "target_layer_ids": [1, 3, 4]}
        c.pop("dspine_config")

    with pytest.raises(ValueError, match=r"not a DSpine draft.*method 'dflash'"):
        _build(pair.target_dir, _variant(pair, tmp_path, to_dflash))
