import os
os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest


@pytest.fixture
def one_thread():
    """One torch thread for the test (modules of small CPU ops use it for all their tests:
    two threads on a busy 2-core box run those many times slower than one)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def tiny_trained_pair(tmp_path_factory):
    """The tiny pair with its distilled drafter (`write_tiny_pair(seed=0, trained=True)`:
    deterministic, ~1.5 min of distillation), written once per test session and only
    read by the modules that use it (under their own fixture name `pair`)."""
    from vllm_dspine.pairs.tiny import write_tiny_pair

    return write_tiny_pair(str(tmp_path_factory.mktemp("tiny_trained_pair")), seed=0,
                           trained=True)


@pytest.fixture(scope="session")
def hybrid_trained_pair(tmp_path_factory):
    """The hybrid pair (`write_hybrid_pair(seed=0)`: the target bytes of
    `python -m vllm_dspine.pairs hybrid`) with its drafter distilled from the target for a
    short while, so that drafts are accepted (~0.3 tokens a block) and the replay commits
    more than one position on some steps; written once per test session for
    tests/test_hybrid_engine.py and tests/test_hybrid_sampled.py (fixture name
    `trained_pair` there)."""
    from hybrid_fixtures import qwen3_5_importable
    from vllm_dspine.pairs.hybrid import write_hybrid_pair
    from vllm_dspine.train.tiny_drafter import TrainSettings, train_tiny_drafter

    assert qwen3_5_importable()
    pair = write_hybrid_pair(str(tmp_path_factory.mktemp("hybrid_trained")), seed=0)
    train_tiny_drafter(pair.target_dir, pair.draft_dir, seed=0, evaluate=False,
                       settings=TrainSettings(steps=160, train_seqs=192))
    return pair


@pytest.fixture(scope="module")
def plain_llm(pair):
    """Plain vLLM (no speculation) on the target of the requesting module's `pair`."""
    from engine_utils import make_llm

    return make_llm(pair.target_dir)
