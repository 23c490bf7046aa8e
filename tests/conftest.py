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


@pytest.fixture(scope="module")
def plain_llm(pair):
    """Plain vLLM (no speculation) on the target of the requesting module's `pair`."""
    from engine_utils import make_llm

    return make_llm(pair.target_dir)
