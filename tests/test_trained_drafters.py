"""The committed distilled drafters of the test pairs (tests/trained_drafters.py) are what
distillation writes today: distilled again here and compared with the committed files.

The trainer runs on one thread from seeded generators, so on the kind of machine that made
the files (same torch, same widest vector unit: the record's `machine`) it repeats them
bit for bit, and that is asserted. Elsewhere float rounding may differ in the last bits
and grow over the steps; there the fresh drafter must reach the committed one's held-out
acceptance (greedy with the tail, within 10 %) instead.

Both are in the `full` tier (docs/testing.md: changes under vllm_dspine/train/ run it);
the default tier tests distillation itself (tests/test_train_tiny.py,
tests/test_distill_loop.py) and uses the committed drafters, whose target hashes are
checked whenever a pair is written (tests/trained_drafters.py).
"""

from __future__ import annotations

import os

import pytest
import torch

from trained_drafters import (committed, distil_hybrid, distil_tiny, machine, record,
                              sha256)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def _compare(kind: str, pair, stats: dict) -> None:
    from vllm_dspine.model.checkpoint import load_draft_checkpoint

    rec = record(kind)
    assert sha256(os.path.join(pair.target_dir, "model.safetensors")) == rec["target_sha256"]
    fresh = sha256(os.path.join(pair.draft_dir, "model.safetensors"))
    assert sha256(committed(kind) / "model.safetensors") == rec["draft_sha256"], \
        f"{committed(kind)}/model.safetensors is not the file its record.json describes"
    if _same_machine(kind):
        _, a = load_draft_checkpoint(pair.draft_dir)
        _, b = load_draft_checkpoint(str(committed(kind)))
        different = [n for n in a if not torch.equal(a[n], b[n])]
        assert fresh == rec["draft_sha256"] and not different, (
            f"distilling the {kind} drafter gave other tensors than {committed(kind)} "
            f"({different[:5]}): make the drafters again with `python "
            f"tests/trained_drafters.py` if the trainer or the pair changed on purpose")
    else:
        got = stats["after"]["acceptance_tail"]
        want = rec["after"]["acceptance_tail"]
        print(f"{kind}: machine {machine()} differs from the record's {rec['machine']}: "
              f"acceptance {got:.3f} against {want:.3f}")
        assert got >= 0.9 * want, (kind, got, want)


def _same_machine(kind: str) -> bool:
    return machine() == record(kind)["machine"]


@pytest.mark.full  # ~58 s on a slow core; distillation itself: tests/test_train_tiny.py
def test_tiny_drafter_distils_to_the_committed_one(tmp_path):
    pair, stats = distil_tiny(str(tmp_path), evaluate=not _same_machine("tiny"))
    _compare("tiny", pair, stats)


@pytest.mark.full
def test_hybrid_drafter_distils_to_the_committed_one(tmp_path):
    from hybrid_fixtures import qwen3_5_importable

    assert qwen3_5_importable()
    pair, stats = distil_hybrid(str(tmp_path), evaluate=not _same_machine("hybrid"))
    _compare("hybrid", pair, stats)
