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
    full = memory_report(released, max_context=131072, max_concurrency=8,
                         kv_allocation="full")
    win = memory_report(released, max_context=131072, max_concurrency=8,
                        kv_allocation="window")
    default = memory_report(released, max_context=131072, max_concurrency=8)
    # default: what the KV planner allocates, the 8,192-position window (shorter than
    # the context), test_default_kv_allocation_is_the_planners
    assert default.kv_allocation == "window"
    assert default.per_request_bytes == win.per_request_bytes
    assert full.shared_bytes == win.shared_bytes
    assert full.per_request_bytes - win.per_request_bytes == int(2.5 * GiB) - 160 * MiB
    assert full.total_bytes == full.shared_bytes + 8 * full.per_request_bytes
    no_fp8 = memory_report(released, max_context=131072, max_concurrency=8, fp8_head=False)
    assert full.shared_bytes - no_fp8.shared_bytes == 248320 * (5120 + 4)
    with pytest.raises(ValueError, match="kv_allocation"):
        memory_report(released, max_context=1, max_concurrency=1, kv_allocation="paged")


def test_default_kv_allocation_is_the_planners():
    """The draft K/V the totals count by default is what the plugin's KV planner
    (model/kv_cache_groups.py, beside the assumed Qwen3.8-27B target) allocates. By hand,
    the released drafter's 20,480 B per position (2 x 5 layers x 8 heads x 128 x 2 B):

    | window | max_context | planner's draft spec | counted per request |
    | 8,192 | 131,072 | sliding window (blocks behind it freed) | 8,192 x 20,480 = 167,772,160 B |
    | 8,192 | 8,192 | full attention (window covers the context) | 8,192 x 20,480 = 167,772,160 B |
    | 8,192 | 4,096 | full attention (window covers the context) | 4,096 x 20,480 = 83,886,080 B |
    | none | 131,072 | full attention | 131,072 x 20,480 = 2,684,354,560 B |

    (plus the block workspace, the other per-request item)."""
    from vllm_dspine.model.kv_cache_groups import layer_kind
    from vllm_dspine.model.memory import QWEN38_27B_TARGET, KVPlanSettings, kv_groups_report

    for window, ctx, kind, kv in [(8192, 131072, "sliding window", 167_772_160),
                                  (8192, 8192, "full attention", 167_772_160),
                                  (8192, 4096, "full attention", 83_886_080),
                                  (None, 131072, "full attention", 2_684_354_560)]:
        cfg = DSpineConfig.from_dict(dict(RELEASED_QWEN38_27B, sliding_window=window))
        plan = kv_groups_report(QWEN38_27B_TARGET, cfg, KVPlanSettings(max_model_len=ctx))
        assert {layer_kind(plan.dspine.specs[n]) for n in plan.dspine.draft_layers} == \
            {kind}, (window, ctx)
        r = memory_report(cfg, max_context=ctx, max_concurrency=1)
        assert r.kv_allocation == ("window" if kind == "sliding window" else "full")
        assert r.per_request_bytes == kv + r.item("block workspace").bytes, (window, ctx)


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


# ------------------------------------------------------------------ KV cache groups
def test_kv_groups_at_released_dims_against_a_hand_computation(released):
    """vLLM 0.32.0's KV cache groups for the assumed Qwen3.8-27B target (48 GDN + 16
    full-attention layers, 4 KV heads x 256) and the released drafter (5 layers, 8 KV
    heads x 128, window 8,192), max_model_len 131,072 on CPU, without and with the row
    dspine-kv-cache-groups (docs/hybrid.md, 'KV cache groups'), by hand:

    block: 128 x cdiv(GDN page 3 x 10,240 x 2 + 48 x 128 x 128 x 4 = 3,207,168 B,
    128 x 4,096 B) = 128 x 7 = 896 tokens; every page 896 x 4,096 = 3,670,016 B (the
    drafter's 8 x 128 K/V per token is the target's 4 x 256: 4,096 B).
    vLLM: buckets 48 / 16 / 5 -> groups of 5 (the smallest): 10 GDN groups (8 x 5 + 2 x 4),
    4 attention groups of 4, the draft's 5: a block is 5 pages, so the target's attention
    holds 4 x 5 x 4,096 = 81,920 B per token for 16 x 4,096 = 65,536 used (1.25 x; 20 %
    of it never used). Per request: 10 GDN blocks + 4 x cdiv(131,072, 896) = 4 x 147
    attention blocks + cdiv(8,191 + 2,048 in flight, 896) + 1 = 13 window blocks = 611
    blocks x 5 pages.
    DSpine: groups of 8: 6 GDN, 2 attention, the draft's 5 (3 slots unused): 6 + 294 + 13
    = 313 blocks x 8 pages; the target's attention 2 x 8 x 4,096 = 65,536 B per token."""
    from vllm_dspine.model.kv_cache_groups import grouping_structure
    from vllm_dspine.model.memory import (
        QWEN38_27B_TARGET,
        KVPlanSettings,
        attention_bytes_per_token,
        hybrid_block_size,
        kv_groups_report,
    )

    page = 896 * 4096
    assert hybrid_block_size(QWEN38_27B_TARGET) == 896
    r = kv_groups_report(QWEN38_27B_TARGET, released, KVPlanSettings(max_model_len=131072))
    assert r.block_size == 896 and r.page_bytes == page == 3_670_016
    assert grouping_structure(r.vllm) == (
        "15 groups of 5 slots: target state x 10 (5+5+5+5+5+5+5+5+4+4 layers), target full "
        "attention x 4 (4+4+4+4 layers), draft sliding window x 1 (5 layers); padding 2 "
        "target state, 4 target full attention; draft layers in 1 group(s)")
    assert attention_bytes_per_token(r.vllm, 896) == (81_920, 65_536)
    assert r.vllm.bytes_per_block == 5 * page
    assert r.vllm.bytes_per_request == (10 + 4 * 147 + 13) * 5 * page  # 10,692.5 MiB
    assert grouping_structure(r.dspine) == (
        "9 groups of 8 slots: target state x 6 (8+8+8+8+8+8 layers), target full attention "
        "x 2 (8+8 layers), draft sliding window x 1 (5 layers); padding 3 draft sliding "
        "window; draft layers in 1 group(s)")
    assert not r.dspine.draft_promoted
    assert attention_bytes_per_token(r.dspine, 896) == (65_536, 65_536)
    assert r.dspine.bytes_per_request == (6 + 2 * 147 + 13) * 8 * page  # 8,764.0 MiB
    # max_model_len within the window: the draft allocated as full attention (a window
    # allocation keeps the in-flight tokens and one block more)
    short = kv_groups_report(QWEN38_27B_TARGET, released, KVPlanSettings(max_model_len=8192))
    assert short.dspine.draft_promoted
    assert short.dspine.bytes_per_request == (6 + 2 * 10 + 10) * 8 * page  # cdiv(8192, 896)


def test_kv_cache_specs_of_the_hybrid_pair_are_the_engines():
    """The specs the planner builds for the hybrid pair are those vLLM's engine built
    (the specs its engine core grouped, read on 2026-12-03, prefix caching on): block
    384 tokens (3 x 128), the GDN state page 3 x 512 x 2 + 2 x 128 x 128 x 4 = 134,144 B
    padded to the attention page 384 x 512 = 196,608 B (46.56 %, the figure in the
    engine's log, docs/hybrid.md), the drafter's layers numbered after the target's."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    from vllm_dspine.model.memory import KVPlanSettings, kv_cache_specs, target_kv_dims
    from vllm_dspine.pairs.hybrid import draft_config, target_config

    target = target_kv_dims(target_config())
    specs = kv_cache_specs(target, draft_config(8192),
                           KVPlanSettings(max_model_len=1536, mamba_cache_mode="align"))
    assert list(specs) == ["model.layers.0.linear_attn", "model.layers.1.linear_attn",
                           "model.layers.2.linear_attn", "model.layers.3.self_attn.attn",
                           "model.layers.4.self_attn.attn", "model.layers.5.self_attn.attn"]
    state = specs["model.layers.0.linear_attn"]
    assert isinstance(state, MambaSpec) and state.block_size == 384
    assert state.page_size_padded == 196_608 and state.real_page_size_bytes == 134_144
    assert round(100 * (196_608 - 134_144) / 134_144, 2) == 46.56
    assert state.num_speculative_blocks == 0 and state.mamba_cache_mode == "align"
    attn = specs["model.layers.3.self_attn.attn"]
    assert type(attn) is FullAttentionSpec and attn.page_size_bytes == 196_608
    draft = specs["model.layers.5.self_attn.attn"]
    assert isinstance(draft, SlidingWindowSpec) and draft.sliding_window == 8192
    assert draft.page_size_bytes == 196_608


def test_kv_groups_cli(capsys):
    main(["--config", "released", "--max-context", "131072", "--kv-groups"])
    out = capsys.readouterr().out
    assert "block 896 tokens, page 3,670,016 B" in out
    assert "| vLLM 0.32.0 | 10 x target state (5/4); 4 x target full attention (4); 1 x " \
           "draft sliding window (5) | 5 | 2 target state, 4 target full attention | 1 group " \
           "| 81,920 / 65,536 | 10,692.5 |" in out
    assert "| DSpine (dspine-kv-cache-groups) | 6 x target state (8); 2 x target full " \
           "attention (8); 1 x draft sliding window (5) | 8 | 3 draft sliding window | " \
           "1 group | 65,536 / 65,536 | 8,764.0 |" in out
