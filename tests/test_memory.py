"""Memory arithmetic against the article's figures for the released drafter, and against
what the code allocates (the tail tables)."""

import pytest
import torch

from vllm_dspine.config import RELEASED_QWEN38_27B, DSpineConfig
from vllm_dspine.kernels.tail import TailTables
from vllm_dspine.model.checkpoint import (bridge_weights, expected_tensor_shapes,
                                          random_draft_tensors)
from vllm_dspine.model.memory import (TAIL_TABLE_DTYPE_BYTES, GiB, MiB, format_report, main,
                                      memory_report)


@pytest.fixture
def released():
    return DSpineConfig.from_dict(RELEASED_QWEN38_27B)


def test_article_figures(released):
    r = memory_report(released, max_context=131072, max_concurrency=8)
    assert r.kv_bytes_per_position == 20_480
    assert r.item("draft KV, allocated (full context)").bytes == int(2.5 * GiB)
    assert r.item("draft KV, logical window").bytes == 160 * MiB  # 8,192-position window
    assert r.item("bridge codebook").bytes == 485 * MiB
    # What the proposer builds (TailTables.build's default, fp32): twice the article's
    # 727.5 MiB of BF16 tables, which the report gives when asked for 2-byte tables.
    assert TAIL_TABLE_DTYPE_BYTES == 4
    assert r.item("greedy tail tables").bytes == 1455 * MiB
    assert r.item("greedy tail Gram matrix").bytes == 512 * 512 * 4
    bf16 = memory_report(released, max_context=131072, max_concurrency=8,
                         tail_table_dtype_bytes=2)
    assert bf16.item("greedy tail tables").bytes == int(727.5 * MiB)
    assert r.shared_bytes - bf16.shared_bytes == int(727.5 * MiB) + 512 * 512 * 2
    assert r.item("FP8 head copy + scales").bytes == 248320 * 5120 + 248320 * 4
    r8k = memory_report(released, max_context=8192, max_concurrency=1)
    assert r8k.item("draft KV, allocated (full context)").bytes == 160 * MiB


def test_weights_add_up_to_the_checkpoint(released):
    r = memory_report(released, max_context=1024, max_concurrency=1, weight_dtype_bytes=2)
    weights = sum(r.item(n).bytes for n in
                  ("draft layers", "fc + norms", "bridge codebook", "bridge projections"))
    numel = 0
    for shape in expected_tensor_shapes(released).values():
        n = 1
        for s in shape:
            n *= s
        numel += n
    assert weights == 2 * numel


def test_tail_items_are_what_tail_tables_build_allocates():
    """The report's tail items against the bytes `TailTables.build` really allocates,
    called as the proposer calls it (no dtype), on the tiny drafter's sizes."""
    from vllm_dspine.pairs.tiny import draft_config

    cfg = draft_config()
    tensors = random_draft_tensors(cfg, seed=0)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size)
    tables = TailTables.build(bridge_weights(cfg, tensors), head, tensors["norm.weight"])
    r = memory_report(cfg, max_context=64, max_concurrency=1)
    allocated = tables.pred_proj.nbytes + tables.head_write.nbytes
    assert r.item("greedy tail tables").bytes == allocated
    assert r.item("greedy tail Gram matrix").bytes == tables.gram.nbytes
    assert tables.pred_proj.element_size() == TAIL_TABLE_DTYPE_BYTES


def test_totals_and_kv_allocation(released):
    full = memory_report(released, max_context=131072, max_concurrency=8)
    win = memory_report(released, max_context=131072, max_concurrency=8,
                        kv_allocation="window")
    assert full.kv_allocation == "full"  # default: what vLLM allocates today
    assert full.shared_bytes == win.shared_bytes
    assert full.per_request_bytes - win.per_request_bytes == int(2.5 * GiB) - 160 * MiB
    assert full.total_bytes == full.shared_bytes + 8 * full.per_request_bytes
    no_fp8 = memory_report(released, max_context=131072, max_concurrency=8, fp8_head=False)
    assert full.shared_bytes - no_fp8.shared_bytes == 248320 * (5120 + 4)
    with pytest.raises(ValueError, match="kv_allocation"):
        memory_report(released, max_context=1, max_concurrency=1, kv_allocation="paged")


def test_no_window_means_full_context(released):
    d = dict(RELEASED_QWEN38_27B, sliding_window=None)
    r = memory_report(DSpineConfig.from_dict(d), max_context=65536, max_concurrency=1)
    assert r.item("draft KV, logical window").bytes == 65536 * 20_480


def test_format_and_cli(released, capsys):
    text = format_report(memory_report(released, max_context=131072, max_concurrency=8))
    assert "| bridge codebook | 485.0 |" in text
    assert "| greedy tail tables | 1,455.0 |" in text
    assert "| draft KV, allocated (full context) | 2,560.0 |" in text
    main(["--config", "released", "--max-context", "8192", "--concurrency", "2"])
    out = capsys.readouterr().out
    assert "| draft KV, allocated (full context) | 160.0 |" in out
    assert "**total**" in out
    main(["--config", "released", "--tail-table-dtype-bytes", "2"])
    assert "| greedy tail tables | 727.5 |" in capsys.readouterr().out
