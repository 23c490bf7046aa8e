"""What a DSpine drafter keeps resident, as arithmetic from its config (no allocation).

Counts payload bytes only: no allocator rounding, paging slack, CUDA graphs or the target's
own state. The figures for the released Qwen3.8-27B drafter reproduce the article's:
20,480 B of draft K/V per retained position, 160 MiB for an 8,192-position window, 2.5 GiB
for 131,072 positions, a 485 MiB codebook and 727.5 MiB of greedy-tail tables.

    python -m vllm_dspine.model.memory --config DRAFT_DIR|released --max-context 131072 --concurrency 8
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from vllm_dspine.model.checkpoint import expected_tensor_shapes
from vllm_dspine.config import RELEASED_QWEN38_27B, DSpineConfig

MiB = 1 << 20
GiB = 1 << 30
FP32 = 4
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

# Which draft K/V size counts in the totals. vLLM allocates draft K/V for the full context
# unless the drafter's layers get a sliding-window KV spec, which our integration does not
# use yet: "full" is the default. "window" is what an allocator that reclaims positions
# behind the sliding window would hold.
KV_ALLOCATIONS = ("full", "window")


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
        "16x16 tail tables (fp32)": P * K * K * FP32,
        "refined states x'(u) (fp32)": P * K * H * FP32,
    }
    total = sum(parts.values())
    biggest = max(parts, key=parts.get)
    return total, f"estimate of live activations; largest part: {biggest}"


def memory_report(cfg: DSpineConfig, *, max_context: int, max_concurrency: int,
                  kv_dtype_bytes: int = 2, weight_dtype_bytes: int = 2,
                  fp8_head: bool = True, kv_allocation: str = "full") -> MemoryReport:
    """Resident bytes of the drafter for `max_concurrency` requests of up to `max_context`.

    kv_allocation: "full" (vLLM's allocation without a sliding-window KV spec; our
    integration today) or "window" (positions behind `sliding_window` reclaimed).
    """
    if max_context <= 0 or max_concurrency <= 0:
        raise ValueError(f"memory_report: max_context and max_concurrency must be > 0, got "
                         f"{max_context} and {max_concurrency}")
    if kv_allocation not in KV_ALLOCATIONS:
        raise ValueError(f"memory_report: kv_allocation must be one of {KV_ALLOCATIONS}, "
                         f"got {kv_allocation!r}")
    H, V, C, M = cfg.hidden_size, cfg.vocab_size, cfg.code_dim, cfg.message_dim
    L, D, nkv = cfg.num_hidden_layers, cfg.head_dim, cfg.num_key_value_heads
    wb = weight_dtype_bytes

    per_pos = 2 * L * nkv * D * kv_dtype_bytes  # K and V, every draft layer
    window = max_context if cfg.sliding_window is None else min(max_context,
                                                                 cfg.sliding_window)
    groups = _weight_groups(cfg)
    workspace, workspace_note = _block_workspace_bytes(cfg, wb)
    items = [
        MemoryItem(
            "draft KV, allocated (full context)", max_context * per_pos, True,
            f"{per_pos:,} B/position x {max_context:,} positions; what vLLM allocates "
            f"without a sliding-window KV spec", in_total=kv_allocation == "full"),
        MemoryItem(
            "draft KV, logical window", window * per_pos, True,
            f"{per_pos:,} B/position x {window:,} positions (sliding_window="
            f"{cfg.sliding_window}); what attention reads", in_total=kv_allocation == "window"),
        MemoryItem("draft layers", groups["layers"] * wb, False,
                   f"{L} layers: attention, MLP, norms"),
        MemoryItem("fc + norms", groups["fc_norms"] * wb, False,
                   "fc [H, F*H], hidden_norm, norm"),
        MemoryItem("bridge codebook", groups["codebook"] * wb, False, f"E [V, C] = [{V}, {C}]"),
        MemoryItem("bridge projections", groups["bridge"] * wb, False,
                   "read [C, H] and write [H, M] per layer; G, Gp, A [M, C]; b [M]"),
        MemoryItem("greedy tail tables", V * 3 * M * wb, False,
                   f"[V, 2M] (Gp E, A E stacked) + [V, M] ((head*g) W_L) = [{V}, {2 * M}] + "
                   f"[{V}, {M}]"),
        MemoryItem("greedy tail Gram matrix", M * M * FP32, False,
                   f"W_L^T W_L [M, M] = [{M}, {M}] fp32"),
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
    ap.add_argument("--kv-allocation", choices=KV_ALLOCATIONS, default="full")
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
                           fp8_head=not args.no_fp8_head, kv_allocation=args.kv_allocation)
    print(format_report(report))


if __name__ == "__main__":
    main()
