"""What a DSpine drafter keeps resident, as arithmetic from its config (no allocation).

Counts payload bytes only: no allocator rounding, paging slack, CUDA graphs or the target's
own state. The figures for the released Qwen3.8-27B drafter reproduce the article's:
20,480 B of draft K/V per retained position, 160 MiB for an 8,192-position window, 2.5 GiB
for 131,072 positions and a 485 MiB codebook. The greedy-tail tables are counted as the
code allocates them: `TailTables.build` (what the proposer calls at load) builds them in
fp32, 1,455 MiB at the released sizes, twice the article's 727.5 MiB of BF16 tables
(`--tail-table-dtype-bytes 2` shows that figure).

    python -m vllm_dspine.model.memory --config DRAFT_DIR|released --max-context 131072 --concurrency 8

`--kv-groups` also prints vLLM's KV cache groups of a hybrid target (the assumed Qwen3.8-27B
by default, `--target DIR`) and the drafter, without and with the plugin's row
`dspine-kv-cache-groups`: padding, attention KV bytes per token, bytes per request
(docs/memory.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from dataclasses import dataclass, field

import torch

from vllm_dspine.config import RELEASED_QWEN38_27B, DSpineConfig
from vllm_dspine.kernels.tail import TailTables
from vllm_dspine.model.checkpoint import expected_tensor_shapes
from vllm_dspine.model.kv_cache_groups import (KVCacheGrouping, plan_kv_cache_groups,
                                                window_covers)

MiB = 1 << 20
GiB = 1 << 30
FP32 = 4
FP64 = 8
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

# The dtype `TailTables.build` allocates its per-token tables in when the caller does not
# pass one (the proposer does not): read from the code, so the report follows it.
TAIL_TABLE_DTYPE_BYTES = torch.empty(
    (), dtype=inspect.signature(TailTables.build).parameters["dtype"].default).element_size()

# Which draft K/V size counts in the totals: "full" (every position of the context) or
# "window" (the sliding window's positions: blocks behind it freed). The default is what
# the KV planner allocates (`planned_kv_allocation`).
KV_ALLOCATIONS = ("full", "window")


def planned_kv_allocation(cfg: DSpineConfig, max_context: int) -> str:
    """The draft K/V the plugin's KV planner (row `dspine-kv-cache-groups`,
    `model/kv_cache_groups.py`) allocates for `max_context` (= max_model_len): "window"
    when the drafter has a sliding window shorter than the context (its layers keep
    vLLM's sliding-window KV spec, blocks behind the window freed), else "full" (no
    window, or a window covering the context: every position kept)."""
    return "full" if window_covers(cfg.sliding_window, max_context) else "window"


@dataclass(frozen=True)
class MemoryItem:
    name: str
    bytes: int
    per_request: bool  # True: once per running request; False: once per engine
    note: str = ""
    in_total: bool = True  # False: shown for comparison, not counted (an alternative)


@dataclass
class MemoryReport:
    max_context: int
    max_concurrency: int
    kv_bytes_per_position: int  # draft K/V of one retained position, all layers
    kv_allocation: str  # "full" or "window": which draft K/V item the totals count
    items: list[MemoryItem] = field(default_factory=list)

    def item(self, name: str) -> MemoryItem:
        for it in self.items:
            if it.name == name:
                return it
        raise KeyError(f"no memory item named {name!r}; have {[i.name for i in self.items]}")

    @property
    def shared_bytes(self) -> int:
        return sum(i.bytes for i in self.items if i.in_total and not i.per_request)

    @property
    def per_request_bytes(self) -> int:
        return sum(i.bytes for i in self.items if i.in_total and i.per_request)

    @property
    def total_bytes(self) -> int:
        return self.shared_bytes + self.max_concurrency * self.per_request_bytes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _weight_groups(cfg: DSpineConfig) -> dict[str, int]:
    """Parameter counts of the checkpoint, grouped as the report lists them."""
    groups = {"layers": 0, "fc_norms": 0, "codebook": 0, "bridge": 0}
    for name, shape in expected_tensor_shapes(cfg).items():
        if name.startswith("layers."):
            groups["layers"] += _numel(shape)
        elif name == "bridge.codebook":
            groups["codebook"] += _numel(shape)
        elif name.startswith("bridge."):
            groups["bridge"] += _numel(shape)
        else:  # fc, hidden_norm, norm
            groups["fc_norms"] += _numel(shape)
    return groups


def _block_workspace_bytes(cfg: DSpineConfig, act_bytes: int) -> tuple[int, str]:
    """Live activations of one request's block step: an estimate, not a measured peak."""
    B, H, I, V = cfg.block_size, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    C, M, K, L = cfg.code_dim, cfg.message_dim, cfg.head_topk, cfg.num_hidden_layers
    P, F = cfg.num_proposals, cfg.num_target_features
    q_width = cfg.num_attention_heads * cfg.head_dim
    kv_width = 2 * cfg.num_key_value_heads * cfg.head_dim
    parts = {
        # the block's hidden states: residual, normed input, attention out, q, k/v
        "block states": B * (3 * H + q_width + kv_width) * act_bytes,
        "MLP intermediate": B * 2 * I * act_bytes,
        "target features of the committed block": B * F * H * act_bytes,
        "codes + rms, all layers (fp32)": L * B * (C + 1) * FP32,
        "messages (fp32)": B * M * FP32,
        "full-vocab candidate scores (fp32)": P * V * FP32,
        "candidate ids + probs": P * K * (8 + FP32),
        "16x16 tail tables (fp64 when sampling)": P * K * K * FP64,
        "refined states x'(u) (fp32)": P * K * H * FP32,
    }
    total = sum(parts.values())
    biggest = max(parts, key=parts.get)
    return total, f"estimate of live activations; largest part: {biggest}"


def memory_report(cfg: DSpineConfig, *, max_context: int, max_concurrency: int,
                  kv_dtype_bytes: int = 2, weight_dtype_bytes: int = 2,
                  fp8_head: bool = True, kv_allocation: str | None = None,
                  tail_table_dtype_bytes: int = TAIL_TABLE_DTYPE_BYTES) -> MemoryReport:
    """Resident bytes of the drafter for `max_concurrency` requests of up to `max_context`.

    kv_allocation: which draft K/V item the totals count, "full" (every position) or
    "window" (positions behind `sliding_window` reclaimed); None (the default): what the
    KV planner allocates (`planned_kv_allocation`: "window" when the window is shorter
    than `max_context`). vLLM also keeps the tokens in flight and a block beyond the
    window (payload only here).
    tail_table_dtype_bytes: element size of the per-token tail tables; the default is what
    `TailTables.build` allocates without a dtype (fp32, what the proposer builds), not the
    weight dtype.
    """
    if max_context <= 0 or max_concurrency <= 0:
        raise ValueError(f"memory_report: max_context and max_concurrency must be > 0, got "
                         f"{max_context} and {max_concurrency}")
    if kv_allocation is None:
        kv_allocation = planned_kv_allocation(cfg, max_context)
    if kv_allocation not in KV_ALLOCATIONS:
        raise ValueError(f"memory_report: kv_allocation must be one of {KV_ALLOCATIONS}, "
                         f"got {kv_allocation!r}")
    H, V, C, M = cfg.hidden_size, cfg.vocab_size, cfg.code_dim, cfg.message_dim
    L, D, nkv = cfg.num_hidden_layers, cfg.head_dim, cfg.num_key_value_heads
    wb = weight_dtype_bytes
    tb = tail_table_dtype_bytes

    per_pos = 2 * L * nkv * D * kv_dtype_bytes  # K and V, every draft layer
    window = max_context if cfg.sliding_window is None else min(max_context,
                                                                 cfg.sliding_window)
    groups = _weight_groups(cfg)
    workspace, workspace_note = _block_workspace_bytes(cfg, wb)
    items = [
        MemoryItem(
            "draft KV, allocated (full context)", max_context * per_pos, True,
            f"{per_pos:,} B/position x {max_context:,} positions; what vLLM allocates "
            f"for a drafter without a window or one covering the context",
            in_total=kv_allocation == "full"),
        MemoryItem(
            "draft KV, logical window", window * per_pos, True,
            f"{per_pos:,} B/position x {window:,} positions (sliding_window="
            f"{cfg.sliding_window}); what attention reads, and what vLLM allocates for a "
            f"shorter window (sliding-window KV spec)", in_total=kv_allocation == "window"),
        MemoryItem("draft layers", groups["layers"] * wb, False,
                   f"{L} layers: attention, MLP, norms"),
        MemoryItem("fc + norms", groups["fc_norms"] * wb, False,
                   "fc [H, F*H], hidden_norm, norm"),
        MemoryItem("bridge codebook", groups["codebook"] * wb, False, f"E [V, C] = [{V}, {C}]"),
        MemoryItem("bridge projections", groups["bridge"] * wb, False,
                   "read [C, H] and write [H, M] per layer; G, Gp, A [M, C]; b [M]"),
        MemoryItem("greedy tail tables", V * 3 * M * tb, False,
                   f"[V, 2M] (Gp E, A E stacked) + [V, M] ((head*g) W_L) = [{V}, {2 * M}] + "
                   f"[{V}, {M}] at {tb} B (TailTables.build)"),
        MemoryItem("greedy tail Gram matrix", M * M * tb, False,
                   f"W_L^T W_L [M, M] = [{M}, {M}] at {tb} B (TailTables.build)"),
    ]
    if fp8_head:
        items.append(MemoryItem("FP8 head copy + scales", V * H + V * FP32, False,
                                f"[{V}, {H}] fp8 + [{V}] fp32 row scales (target head copy)"))
    items.append(MemoryItem("block workspace", workspace, True, workspace_note))
    return MemoryReport(max_context=max_context, max_concurrency=max_concurrency,
                        kv_bytes_per_position=per_pos, kv_allocation=kv_allocation,
                        items=items)


def format_report(report: MemoryReport) -> str:
    """A markdown table in MiB, with the totals."""
    lines = [
        f"Draft memory, max_context={report.max_context:,}, "
        f"concurrency={report.max_concurrency}, draft KV counted as '{report.kv_allocation}' "
        f"({report.kv_bytes_per_position:,} B per position)",
        "",
        "| item | MiB | scope | note |",
        "| --- | ---: | --- | --- |",
    ]
    for it in report.items:
        scope = "per request" if it.per_request else "shared"
        if not it.in_total:
            scope += " (not in total)"
        lines.append(f"| {it.name} | {it.bytes / MiB:,.1f} | {scope} | {it.note} |")
    shared, per_req = report.shared_bytes / MiB, report.per_request_bytes / MiB
    lines += [
        f"| **shared** | {shared:,.1f} | | |",
        f"| **per request** | {per_req:,.1f} | | |",
        f"| **total** | {report.total_bytes / MiB:,.1f} | | shared + {report.max_concurrency}"
        f" x per request |",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------
# Hybrid GDN target state (docs/hybrid.md): one slot per request (the replay commit,
# vllm_dspine/commit/) vs vLLM's speculative layout of 1 + K slots. The target's state,
# not the drafter's: reported on its own, not part of `memory_report`'s totals.
@dataclass(frozen=True)
class GDNTargetDims:
    """What sizes a hybrid target's GDN state (Qwen3.5 / Qwen3-Next text config names)."""
    num_gdn_layers: int  # layers with layer_type "linear_attention"
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    state_dtype_bytes: int = 4  # recurrent state: mamba_ssm_dtype float32 in Qwen3.5 configs
    conv_dtype_bytes: int = 2  # conv window: the model dtype (bf16)


# Assumed Qwen3.8-27B dims: the public Qwen3.5-27B / Qwen3.6-27B text config (64 layers,
# full_attention_interval 4 -> 48 GDN layers; 16 key / 48 value heads of 128; conv 4; fp32
# state). The article gives no GDN sizes.
QWEN38_27B_GDN = GDNTargetDims(num_gdn_layers=48, linear_num_key_heads=16,
                               linear_num_value_heads=48, linear_key_head_dim=128,
                               linear_value_head_dim=128, linear_conv_kernel_dim=4)


@dataclass(frozen=True)
class GDNStateMemory:
    num_gdn_layers: int
    num_spec: int  # K = num_speculative_tokens
    conv_dim: int  # 2 H K + HV V
    state_bytes: int  # one recurrent state [HV, V, K], one layer
    speculative_page_bytes: int  # vLLM's page with spec: conv [D, W-1+K] + state
    replay_page_bytes: int  # the replay's page: conv [D, W-1] + state
    replay_inputs_bytes: int  # per layer: (K+1) x (mixed_qkv [D] + a, b [HV]), in flight

    @property
    def speculative_per_request(self) -> int:  # (1 + K) pages per GDN layer
        return self.num_gdn_layers * (1 + self.num_spec) * self.speculative_page_bytes

    @property
    def replay_per_request(self) -> int:  # 1 page + the block's inputs per GDN layer
        return self.num_gdn_layers * (self.replay_page_bytes + self.replay_inputs_bytes)


def gdn_state_memory(dims: GDNTargetDims, num_spec: int = 15) -> GDNStateMemory:
    """GDN state bytes per request: vLLM 0.32.0's speculative layout (`MambaSpec` with
    `num_speculative_blocks = K`: 1 + K pages, each a conv window widened to W - 1 + K plus
    a state, `gated_delta_net_state_shape(num_spec=K)`) vs the replay commit (one page of
    W - 1 + state, plus the verified block's inputs kept from the verify forward to the
    commit). Payload only: vLLM also pads a hybrid model's state page to the attention
    page size."""
    H, HV = dims.linear_num_key_heads, dims.linear_num_value_heads
    K, V, W = dims.linear_key_head_dim, dims.linear_value_head_dim, dims.linear_conv_kernel_dim
    D = 2 * H * K + HV * V
    state = HV * V * K * dims.state_dtype_bytes
    cb = dims.conv_dtype_bytes
    return GDNStateMemory(
        num_gdn_layers=dims.num_gdn_layers, num_spec=num_spec, conv_dim=D,
        state_bytes=state, speculative_page_bytes=D * (W - 1 + num_spec) * cb + state,
        replay_page_bytes=D * (W - 1) * cb + state,
        replay_inputs_bytes=(num_spec + 1) * (D + 2 * HV) * cb)


def format_gdn_state_memory(m: GDNStateMemory) -> str:
    """A markdown table in MiB per request: 1 + K slots vs 1 slot."""
    L, K = m.num_gdn_layers, m.num_spec
    return "\n".join([
        f"Target GDN state per request, {L} GDN layers, K = {K} speculative tokens",
        "",
        "| layout | per layer | MiB per request |",
        "| --- | --- | ---: |",
        f"| vLLM speculative: 1 + K = {1 + K} slots | {1 + K} x {m.speculative_page_bytes:,} B "
        f"| {m.speculative_per_request / MiB:,.1f} |",
        f"| replay commit: 1 slot + block inputs | {m.replay_page_bytes:,} B + "
        f"{m.replay_inputs_bytes:,} B | {m.replay_per_request / MiB:,.1f} |",
    ])
# ------------------------------------------------------------------ end hybrid GDN state


# ------------------------------------------------------------------------------------
# KV cache groups (docs/hybrid.md, "KV cache groups"): how vLLM splits a hybrid target's
# and the drafter's KV layers into groups, without and with the plugin's row
# `dspine-kv-cache-groups`, from KV specs built as vLLM 0.32.0 builds them. vLLM's own
# functions group the layers and count the bytes; only the specs and the attention block
# size are restated here.
@dataclass(frozen=True)
class TargetKVDims:
    """What sizes a hybrid target's KV cache (Qwen3.5 / Qwen3-Next text config names)."""
    layer_types: tuple[str, ...]  # per layer: "linear_attention" (GDN) or "full_attention"
    num_key_value_heads: int  # full attention
    head_dim: int
    gdn: GDNTargetDims | None  # None: no GDN layer
    kv_dtype_bytes: int = 2  # bf16 K/V

    def __post_init__(self):
        if set(self.layer_types) - {"linear_attention", "full_attention"}:
            raise ValueError(f"TargetKVDims: unknown layer types in {set(self.layer_types)}")
        n_gdn = self.layer_types.count("linear_attention")
        if (self.gdn.num_gdn_layers if self.gdn else 0) != n_gdn:
            raise ValueError(f"TargetKVDims: {n_gdn} linear_attention layers, GDN dims for "
                             f"{self.gdn.num_gdn_layers if self.gdn else 0}")


# Assumed Qwen3.8-27B dims (docs/hybrid.md): the public Qwen3.5-27B text config, 64 layers
# of (3 GDN, 1 full attention) x 16; full attention with 4 KV heads of 256.
QWEN38_27B_TARGET = TargetKVDims(
    layer_types=("linear_attention", "linear_attention", "linear_attention",
                 "full_attention") * 16,
    num_key_value_heads=4, head_dim=256, gdn=QWEN38_27B_GDN)

# vLLM 0.32.0 on CPU aligns a hybrid model's attention block size to 128 tokens (its CPU
# attention backend's kernel block; the hybrid pair gets 3 x 128 = 384).
CPU_BLOCK_ALIGNMENT = 128


def target_kv_dims(config: dict) -> TargetKVDims:
    """TargetKVDims from a Qwen3.5 / Qwen3-Next config.json (its `text_config` if any)."""
    c = config.get("text_config", config)
    n = c["num_hidden_layers"]
    types = c.get("layer_types") or [
        "full_attention" if (i + 1) % c["full_attention_interval"] == 0
        else "linear_attention" for i in range(n)]
    n_gdn = list(types).count("linear_attention")
    gdn = None if n_gdn == 0 else GDNTargetDims(
        num_gdn_layers=n_gdn, linear_num_key_heads=c["linear_num_key_heads"],
        linear_num_value_heads=c["linear_num_value_heads"],
        linear_key_head_dim=c["linear_key_head_dim"],
        linear_value_head_dim=c["linear_value_head_dim"],
        linear_conv_kernel_dim=c["linear_conv_kernel_dim"],
        state_dtype_bytes=_DTYPE_BYTES[c.get("mamba_ssm_dtype") or "float32"])
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return TargetKVDims(layer_types=tuple(types), num_key_value_heads=c["num_key_value_heads"],
                        head_dim=head_dim, gdn=gdn)


@dataclass(frozen=True)
class KVPlanSettings:
    """The engine settings vLLM's KV grouping and memory count read."""
    max_model_len: int
    max_num_batched_tokens: int = 2048  # x 2 in flight with asynchronous scheduling
    max_concurrent_batches: int = 1
    mamba_cache_mode: str = "none"  # "align" with prefix caching
    block_alignment: int = CPU_BLOCK_ALIGNMENT


def _torch_dtype(nbytes: int) -> torch.dtype:
    return {2: torch.bfloat16, 4: torch.float32}[nbytes]


def planning_config(settings: KVPlanSettings):
    """A stand-in for vLLM's VllmConfig with what `get_kv_cache_groups` and
    `_max_memory_usage_bytes_from_groups` read (no engine; the KV cache layout is the
    CPU's, layer-outermost: pages of one size per layer)."""
    from types import SimpleNamespace

    from vllm.v1.kv_cache_layout import KVCacheLayout

    return SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=settings.max_model_len),
        cache_config=SimpleNamespace(mamba_cache_mode=settings.mamba_cache_mode,
                                     get_resolved_kv_cache_layout=lambda: KVCacheLayout.LBHNC),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False,
                                         max_num_batched_tokens=settings.max_num_batched_tokens),
        attention_config=None, speculative_config=None,
        max_in_flight_tokens=settings.max_concurrent_batches * settings.max_num_batched_tokens)


def hybrid_block_size(target: TargetKVDims, block_alignment: int = CPU_BLOCK_ALIGNMENT) -> int:
    """The attention block size vLLM picks for a hybrid target: the smallest multiple of
    the alignment whose attention page holds a GDN state page (vLLM's
    `Platform._align_hybrid_block_size`, restated; the GDN state of the replay commit,
    one slot). Without GDN layers, the alignment."""
    attn_per_token, state_page = _attention_page_per_token(target), _gdn_state_page(target)
    if state_page is None:
        return block_alignment
    return block_alignment * -(-state_page // (block_alignment * attn_per_token))


def _attention_page_per_token(target: TargetKVDims) -> int:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=1, num_kv_heads=target.num_key_value_heads,
                             head_size=target.head_dim,
                             dtype=_torch_dtype(target.kv_dtype_bytes)).page_size_bytes


def _gdn_shapes(target: TargetKVDims):
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

    g = target.gdn
    return MambaStateShapeCalculator.gated_delta_net_state_shape(
        1, g.linear_num_key_heads, g.linear_num_value_heads, g.linear_key_head_dim,
        g.linear_value_head_dim, g.linear_conv_kernel_dim, 0)  # replay commit: num_spec 0


def _gdn_state_page(target: TargetKVDims) -> int | None:
    from vllm.v1.kv_cache_interface import MambaSpec

    if target.gdn is None:
        return None
    return MambaSpec(shapes=_gdn_shapes(target), block_size=-1,
                     dtypes=(_torch_dtype(target.gdn.conv_dtype_bytes),
                             _torch_dtype(target.gdn.state_dtype_bytes))).page_size_bytes


def kv_cache_specs(target: TargetKVDims, draft: DSpineConfig,
                   settings: KVPlanSettings) -> dict:
    """Layer name -> vLLM KVCacheSpec, as vLLM 0.32.0 builds them for this target and a
    DSpine drafter (names as vLLM's: the draft's layers numbered after the target's):
    GDN layers a `MambaSpec` of one state slot (the replay commit) padded to the
    attention page, full-attention layers a `FullAttentionSpec`, draft layers a
    `SlidingWindowSpec` when the drafter has a window (vLLM's draft attention layers
    take the target's block size when their backend runs it: CPU) or a
    `FullAttentionSpec`."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    block = hybrid_block_size(target, settings.block_alignment)
    attn_page = block * _attention_page_per_token(target)
    dtype = _torch_dtype(target.kv_dtype_bytes)
    specs: dict = {}
    for i, kind in enumerate(target.layer_types):
        if kind == "linear_attention":
            state = MambaSpec(
                shapes=_gdn_shapes(target), block_size=block if settings.mamba_cache_mode
                == "align" else settings.max_model_len,
                dtypes=(_torch_dtype(target.gdn.conv_dtype_bytes),
                        _torch_dtype(target.gdn.state_dtype_bytes)),
                mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
                mamba_cache_mode=settings.mamba_cache_mode, num_speculative_blocks=0)
            specs[f"model.layers.{i}.linear_attn"] = state if state.page_size_bytes == \
                attn_page else dataclasses.replace(state, page_size_padded=attn_page)
        else:
            specs[f"model.layers.{i}.self_attn.attn"] = FullAttentionSpec(
                block_size=block, num_kv_heads=target.num_key_value_heads,
                head_size=target.head_dim, dtype=dtype)
    for j in range(draft.num_hidden_layers):
        kv = dict(block_size=block, num_kv_heads=draft.num_key_value_heads,
                  head_size=draft.head_dim, dtype=dtype)
        specs[f"model.layers.{len(target.layer_types) + j}.self_attn.attn"] = \
            FullAttentionSpec(**kv) if draft.sliding_window is None else \
            SlidingWindowSpec(**kv, sliding_window=draft.sliding_window)
    return specs


@dataclass(frozen=True)
class KVGroupsReport:
    settings: KVPlanSettings
    block_size: int  # tokens per attention block
    page_bytes: int  # one layer's page (every page after vLLM unifies them)
    vllm: KVCacheGrouping  # vLLM 0.32.0's own grouping (its function's output)
    dspine: KVCacheGrouping  # with the row dspine-kv-cache-groups


def kv_groups_report(target: TargetKVDims, draft: DSpineConfig,
                     settings: KVPlanSettings) -> KVGroupsReport:
    """vLLM's grouping (its `get_kv_cache_groups`, unpatched) and DSpine's
    (`model/kv_cache_groups.py:plan_kv_cache_groups`) of these specs."""
    from vllm.v1.core import kv_cache_utils

    config = planning_config(settings)
    specs = kv_cache_utils.unify_kv_cache_spec_page_size(kv_cache_specs(target, draft,
                                                                         settings))
    draft_layers = frozenset(list(specs)[len(target.layer_types):])
    # The function as vLLM ships it, whether or not this process applied the patches.
    vllm_groups = inspect.unwrap(kv_cache_utils.get_kv_cache_groups)(config, dict(specs))
    vllm = KVCacheGrouping(
        specs=specs, groups=tuple(tuple(g.layer_names) for g in vllm_groups),
        draft_layers=draft_layers, draft_promoted=False,
        bytes_per_request=kv_cache_utils._max_memory_usage_bytes_from_groups(config,
                                                                             vllm_groups),
        bytes_per_block=kv_cache_utils._pool_bytes_per_block(config, vllm_groups))
    return KVGroupsReport(settings=settings, block_size=hybrid_block_size(
        target, settings.block_alignment), page_bytes=next(iter(specs.values())).page_size_bytes,
        vllm=vllm, dspine=plan_kv_cache_groups(config, specs, draft_layers))


def attention_bytes_per_token(g: KVCacheGrouping, block_size: int) -> tuple[int, int]:
    """(allocated, used) KV bytes per context token of the target's full-attention layers:
    each group holding them takes a block of `bytes_per_block` per `block_size` tokens;
    its layers use their own pages of it."""
    allocated = used = 0
    for group in g.groups:
        if g.group_label(group) != "target full attention":
            continue
        allocated += g.bytes_per_block // block_size
        used += sum(g.specs[n].page_size_bytes for n in group) // block_size
    return allocated, used


def format_kv_groups(report: KVGroupsReport, target: TargetKVDims,
                     draft: DSpineConfig) -> str:
    """A markdown table: vLLM's grouping and DSpine's, groups, padding, bytes."""
    s = report.settings
    n_gdn = target.layer_types.count("linear_attention")
    window = draft.sliding_window
    lines = [
        f"KV cache groups, target {len(target.layer_types)} layers ({n_gdn} GDN, "
        f"{len(target.layer_types) - n_gdn} full attention, {target.num_key_value_heads} "
        f"KV heads x {target.head_dim}), drafter {draft.num_hidden_layers} layers "
        f"({'sliding window ' + format(window, ',') if window else 'full attention'}, "
        f"{draft.num_key_value_heads} KV heads x {draft.head_dim}); max_model_len "
        f"{s.max_model_len:,}, block {report.block_size} tokens, page "
        f"{report.page_bytes:,} B, mamba cache mode '{s.mamba_cache_mode}'",
        "",
        "| grouping | groups (layers each) | slots per group | padding (slots) | draft in | "
        "target attention KV B/token (allocated / used) | KV MiB per request at max_model_len |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: |",
    ]
    for name, g in (("vLLM 0.32.0", report.vllm), ("DSpine (dspine-kv-cache-groups)",
                                                    report.dspine)):
        kinds: dict[str, list[int]] = {}
        for group in g.groups:
            kinds.setdefault(g.group_label(group), []).append(len(group))
        groups = "; ".join(f"{len(v)} x {k} ({'/'.join(map(str, sorted(set(v), reverse=True)))})"
                           for k, v in kinds.items())
        pad = ", ".join(f"{v} {k}" for k, v in g.padding().items()) or "none"
        alloc, used = attention_bytes_per_token(g, report.block_size)
        draft_in = f"{g.draft_groups} group" + ("s (does not start)" if g.draft_groups > 1
                                                else "")
        promoted = " (draft allocated as full attention)" if g.draft_promoted else ""
        lines.append(f"| {name}{promoted} | {groups} | {g.group_size} | {pad} | {draft_in} | "
                     f"{alloc:,} / {used:,} | {g.bytes_per_request / MiB:,.1f} |")
    return "\n".join(lines)
# ------------------------------------------------------------------ end KV cache groups


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Resident bytes of a DSpine drafter.")
    ap.add_argument("--config", default="released",
                    help="a draft folder with config.json, or 'released' (Qwen3.8-27B sizes)")
    ap.add_argument("--max-context", type=int, default=131072)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--kv-dtype-bytes", type=int, default=2)
    ap.add_argument("--weight-dtype-bytes", type=int, default=None,
                    help="default: from config.json's torch_dtype")
    ap.add_argument("--no-fp8-head", action="store_true")
    ap.add_argument("--kv-allocation", choices=KV_ALLOCATIONS, default=None,
                    help="which draft K/V the totals count (default: what the KV planner "
                         "allocates: 'window' for a window shorter than --max-context)")
    ap.add_argument("--tail-table-dtype-bytes", type=int, default=TAIL_TABLE_DTYPE_BYTES,
                    help="element size of the per-token tail tables (default: what "
                         "TailTables.build allocates, fp32)")
    ap.add_argument("--gdn-state", action="store_true",
                    help="also print a hybrid target's GDN state per request, 1 + K slots "
                         "vs 1 (assumed Qwen3.8-27B dims, docs/hybrid.md)")
    ap.add_argument("--kv-groups", action="store_true",
                    help="also print vLLM's KV cache groups for the target and drafter, "
                         "without and with the row dspine-kv-cache-groups (docs/hybrid.md); "
                         "max_model_len = --max-context")
    ap.add_argument("--target", default="qwen3.8-27b",
                    help="with --kv-groups: a Qwen3.5 / Qwen3-Next target folder with "
                         "config.json, or 'qwen3.8-27b' (assumed dims, docs/hybrid.md)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="with --kv-groups: tokens in flight (sliding-window blocks kept)")
    ap.add_argument("--mamba-cache-mode", choices=("none", "align"), default="none",
                    help="with --kv-groups: 'align' with prefix caching")
    args = ap.parse_args(argv)
    if args.config == "released":
        cfg = DSpineConfig.from_dict(RELEASED_QWEN38_27B, where="RELEASED_QWEN38_27B")
    else:
        cfg = DSpineConfig.from_pretrained(args.config)
    weight_bytes = args.weight_dtype_bytes or _DTYPE_BYTES[cfg.torch_dtype]
    report = memory_report(cfg, max_context=args.max_context,
                           max_concurrency=args.concurrency,
                           kv_dtype_bytes=args.kv_dtype_bytes,
                           weight_dtype_bytes=weight_bytes,
                           fp8_head=not args.no_fp8_head, kv_allocation=args.kv_allocation,
                           tail_table_dtype_bytes=args.tail_table_dtype_bytes)
    print(format_report(report))
    if args.gdn_state:
        gdn = gdn_state_memory(QWEN38_27B_GDN, num_spec=cfg.num_proposals)
        print("\n" + format_gdn_state_memory(gdn))
    if args.kv_groups:
        if args.target == "qwen3.8-27b":
            target = QWEN38_27B_TARGET
        else:
            import json
            import os

            with open(os.path.join(args.target, "config.json")) as f:
                target = target_kv_dims(json.load(f))
        settings = KVPlanSettings(max_model_len=args.max_context,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  mamba_cache_mode=args.mamba_cache_mode)
        print("\n" + format_kv_groups(kv_groups_report(target, cfg, settings), target, cfg))


if __name__ == "__main__":
    main()
