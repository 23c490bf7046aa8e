"""A draft folder that changes between engine start (config.json and tensor headers
validated in the front end) and the worker's weight load: weights rewritten with other
shapes, other dtypes or other values, weights deleted, config.json edited or broken.
Each must end in a ValueError that names the change and the fix, never in a hang and
never in an engine serving weights other than the validated ones.

The front end records a fingerprint of the folder when it validates it
(`proposer/validation.py`, `model/checkpoint.folder_fingerprint`: parsed config, every
safetensors file's size and mtime, every tensor's dtype and shape); the worker compares
the folder with it when it builds the draft model (before vLLM's loader lists the
files) and compares the tensors it read, and the files, once loading is done
(`model/vllm_model.py`). The unit tests below change the folder after taking the
fingerprint; the engine tests change it at the exact point between validation and
loading (the validation function is wrapped) or while vLLM reads the weights (the
model's `load_weights` is wrapped), in an engine core that runs in the test process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so that the worker's exception reaches the test (2-3 s
each: the start fails before the KV cache is allocated). The same with the engine core
in its own process, as `vllm serve` runs it (~25 s), is in the `full` tier
(docs/testing.md).
"""

from __future__ import annotations

import gc
import json
import os
import shutil

import pytest
import torch

from engine_utils import dspine_spec, make_llm

PAST = 1_600_000_000  # s: the copied folder's files are dated 2020, any rewrite is later


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from vllm_dspine.pairs.tiny import write_tiny_pair

    return write_tiny_pair(str(tmp_path_factory.mktemp("pair")), seed=0)


@pytest.fixture
def draft(pair, tmp_path) -> str:
    """A fresh copy of the draft folder, every file dated PAST."""
    d = str(tmp_path / "draft")
    shutil.copytree(pair.draft_dir, d)
    for name in os.listdir(d):
        os.utime(os.path.join(d, name), (PAST, PAST))
    return d


# --------------------------------------------------------------------- the changes
def _weights_path(d: str) -> str:
    return os.path.join(d, "model.safetensors")


def _rewrite(d: str, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(_weights_path(d))
    edit(tensors)
    save_file(tensors, _weights_path(d), metadata={"format": "pt"})


def _misshaped(d):
    def edit(t):
        t["fc.weight"] = torch.zeros(t["fc.weight"].shape[0], t["fc.weight"].shape[1] + 8)
    _rewrite(d, edit)


def _other_dtype(d):
    def edit(t):
        t["bridge.codebook"] = t["bridge.codebook"].to(torch.bfloat16)
    _rewrite(d, edit)


def _other_values(d):
    def edit(t):
        t["fc.weight"] = t["fc.weight"] * 2  # same name, dtype and shape: only the data
    _rewrite(d, edit)


def _extra_shard(d):
    from safetensors.torch import save_file

    save_file({"fc.bias": torch.zeros(4)}, os.path.join(d, "extra.safetensors"))


def _deleted(d):
    os.remove(_weights_path(d))


def _folder_deleted(d):
    shutil.rmtree(d)


def _edit_config(d, edit):
    path = os.path.join(d, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    edit(cfg)
    with open(path, "w") as f:
        json.dump(cfg, f)


def _config_edited(d):
    _edit_config(d, lambda c: c["dspine_config"].update(head_topk=8))


def _config_resized(d):
    _edit_config(d, lambda c: c.update(intermediate_size=c["intermediate_size"] * 2))


def _config_broken(d):
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write("{not json")


CHANGES = [
    pytest.param(_misshaped, r"tensor 'fc\.weight' has shape \[\d+, \d+\], expected",
                 id="weights-misshaped"),
    pytest.param(_other_dtype, r"tensor 'bridge\.codebook' is BF16 .* validated as F32",
                 id="weights-other-dtype"),
    pytest.param(_other_values, r"'model\.safetensors' was rewritten", id="weights-other-values"),
    pytest.param(_extra_shard, r"unexpected tensor 'fc\.bias'", id="extra-shard"),
    pytest.param(_deleted, r"no \*\.safetensors file", id="weights-deleted"),
    pytest.param(_folder_deleted, r"the draft folder is gone", id="folder-deleted"),
    pytest.param(_config_edited, r"config\.json changed after the start "
                 r"\('dspine_config\.head_topk' was 16, now 8\)", id="config-edited"),
    pytest.param(_config_resized, r"config\.json changed after the start "
                 r"\('intermediate_size' was \d+, now \d+\)", id="config-resized"),
    pytest.param(_config_broken, r"config\.json changed after the start and is no longer "
                 r"valid .*not valid JSON", id="config-broken"),
]
FIX = r"restore it, or restart the engine"


@pytest.mark.parametrize("change, match", CHANGES)
def test_change_after_validation_is_refused_before_loading(draft, change, match):
    from vllm_dspine.model.checkpoint import check_folder_unchanged, folder_fingerprint

    fp = folder_fingerprint(draft)
    check_folder_unchanged(fp)  # unchanged: accepted
    change(draft)
    with pytest.raises(ValueError, match=match) as e:
        check_folder_unchanged(fp)
    assert FIX in str(e.value) and draft in str(e.value)


def test_change_while_loading_is_refused(draft):
    """What vLLM's loader read (dtype, shape, names) and the files after reading are
    compared with the fingerprint: a file replaced while the weights were being read."""
    from safetensors.torch import load_file

    from vllm_dspine.model.checkpoint import (
        check_files_unchanged,
        check_loaded_tensors,
        folder_fingerprint,
    )

    fp = folder_fingerprint(draft)
    read = {n: (t.dtype, tuple(t.shape)) for n, t in load_file(_weights_path(draft)).items()}
    check_loaded_tensors(fp, read, when="while loading")
    check_files_unchanged(fp, when="while loading")
    with pytest.raises(ValueError, match=r"'fc\.weight' is BF16 .* while loading.* "
                                         r"validated as F32"):
        check_loaded_tensors(fp, {**read, "fc.weight": (torch.bfloat16, read["fc.weight"][1])},
                             when="while loading")
    with pytest.raises(ValueError, match=r"tensor 'norm\.weight' disappeared while loading"):
        check_loaded_tensors(fp, {n: v for n, v in read.items() if n != "norm.weight"},
                             when="while loading")
    _other_values(draft)
    with pytest.raises(ValueError, match=r"changed while loading \('model\.safetensors' "
                                         r"was rewritten"):
        check_files_unchanged(fp, when="while loading")


def test_misshaped_checkpoint_is_refused_at_start(pair, draft):
    """A folder whose tensors do not fit its config.json is refused in the front end
    (when vLLM builds its configs), before any engine starts."""
    from engine_utils import engine_env

    engine_env()
    from vllm.engine.arg_utils import EngineArgs

    _misshaped(draft)
    with pytest.raises(ValueError, match=r"tensor 'fc\.weight' has shape"):
        EngineArgs(model=pair.target_dir, dtype="float32",
                   speculative_config=dspine_spec(draft)).create_engine_config()


# --------------------------------------------------------------------- engines
ENGINE_CHANGES = [
    pytest.param(_misshaped, r"tensor 'fc\.weight' has shape", id="weights-misshaped"),
    pytest.param(_deleted, r"no \*\.safetensors file", id="weights-deleted"),
    pytest.param(_config_edited, r"'dspine_config\.head_topk' was 16, now 8",
                 id="config-edited"),
]


def _start_expecting(pair, draft, match):
    with pytest.raises(Exception) as e:
        llm = make_llm(pair.target_dir, dspine_spec(draft, dspine_verify="fixed"),
                       max_num_seqs=4)
        del llm
    gc.collect()
    chain, exc = [], e.value
    while exc is not None:  # the ValueError, or what vLLM wrapped it in
        chain.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    text = "\n".join(chain)
    import re

    print(text[:2000])
    assert re.search(match, text) and FIX in text, text[-3000:]


def _change_after_validation(monkeypatch, draft, change) -> None:
    """The front end's validation wrapped so that `change(draft)` runs right after it
    (between validation and the worker's load)."""
    import vllm_dspine.proposer.validation as validation

    validate = validation.validate_dspine_speculative_config

    def validate_then_change(spec_config, options):
        cfg = validate(spec_config, options)
        change(draft)
        return cfg

    monkeypatch.setattr(validation, "validate_dspine_speculative_config",
                        validate_then_change)


@pytest.mark.engine
@pytest.mark.parametrize("change, match", ENGINE_CHANGES)
def test_engine_refuses_a_folder_changed_between_validation_and_load(
        pair, draft, monkeypatch, change, match):
    """LLM(...): the front end validates the folder, then (the validation function
    wrapped) the folder changes; the worker refuses to load it with the message."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    _change_after_validation(monkeypatch, draft, change)
    _start_expecting(pair, draft, match)


@pytest.mark.engine
@pytest.mark.parametrize("change, match", [
    pytest.param(_other_dtype, r"'bridge\.codebook' is BF16 .* while vLLM was loading",
                 id="weights-other-dtype"),
    pytest.param(_deleted, r"changed while vLLM was loading the draft weights "
                 r"\('model\.safetensors' was deleted\)", id="weights-deleted"),
])
def test_engine_refuses_weights_changed_while_loading(pair, draft, monkeypatch, change,
                                                      match):
    """The weights file changes after the worker's check at model construction, while
    vLLM's loader reads the files (its iterator lists and opens them lazily, inside
    the model's load_weights): replaced by one with a bfloat16 codebook, refused after
    reading (what was read is not what was validated); deleted, vLLM's loader fails
    and the error says the folder changed. Never loaded silently."""
    from vllm_dspine.model.vllm_model import DSpineDraftForCausalLM

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    load = DSpineDraftForCausalLM.load_weights

    def change_then_load(self, weights):
        change(draft)  # before vLLM's iterator has listed or opened any file
        return load(self, weights)

    monkeypatch.setattr(DSpineDraftForCausalLM, "load_weights", change_then_load)
    _start_expecting(pair, draft, match)


@pytest.mark.engine
@pytest.mark.full
def test_engine_core_process_reports_the_change(pair, draft, monkeypatch, capfd):
    """The same with vLLM's engine core in its own process (what `vllm serve` runs):
    the fingerprint travels with the draft's hf_config, the worker refuses the edited
    config.json and logs why; the front end gets vLLM's start-up failure."""
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    _change_after_validation(monkeypatch, draft, _config_edited)
    with pytest.raises(Exception, match="Engine core initialization failed"):
        make_llm(pair.target_dir, dspine_spec(draft, dspine_verify="fixed"), max_num_seqs=4)
    gc.collect()
    out, err = capfd.readouterr()
    log = out + err
    assert "config.json changed after the start ('dspine_config.head_topk' was 16, now 8)" \
        in log and FIX in log, log[-3000:]
