"""How a target's and its DSpine drafter's KV cache layers are split into vLLM's KV cache
groups: vLLM 0.32.0's rule, restated, and DSpine's choice (docs/hybrid.md, "KV cache
groups"). Pure arithmetic on vLLM's own KV specs; nothing is allocated.

vLLM 0.32.0 (`kv_cache_utils._get_kv_cache_groups_uniform_page_size`, for a model whose
layers do not all share one KV spec, once their pages have one size):

1. bucket the layers by KV spec (GDN state, full attention, sliding window; layers whose
   specs `merge` share a bucket);
2. pick a group size G: the smallest bucket's size, or the largest when the largest is
   under 1.5 x the smallest;
3. split each bucket into cdiv(n, G) groups, bucket[i::cdiv(n, G)] (sizes differ by one
   at most), the missing layers counted as "padding".

All groups take their blocks from one pool whose block holds one page per layer of the
largest group (`_get_kv_cache_bytes_per_block`), so a group of fewer layers leaves pages
of every block it holds unused. The drafter's layers must all land in one group (vLLM's
proposer builds one attention metadata for them: `validate_same_kv_cache_group`).

DSpine's choice (`plan_kv_cache_groups`): among the groupings vLLM's splitting can make
(any G; the draft's sliding-window layers kept, or allocated as full attention when the
window covers `max_model_len`; a draft whose spec equals target layers' in their bucket
or in one of its own) that keep every draft layer in one group, the one with
the fewest KV bytes per request at `max_model_len` as vLLM itself counts them
(`_max_memory_usage_bytes_from_groups`, what its admission and capacity checks use);
ties go to vLLM's own grouping, then to the draft's sliding window kept, then to fewer
groups. Allocating a sliding-window layer as full attention changes only which blocks
vLLM keeps: attention still reads only the window (each layer's own setting); vLLM does
the same to every local layer when its hybrid KV cache manager is off
(`_promote_local_kv_cache_specs`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def spec_buckets(specs: dict) -> list[list[str]]:
    """vLLM's buckets, restated from `_get_kv_cache_groups_uniform_page_size`: layers
    with equal specs, in first-seen order; a set of equal specs joins an earlier bucket
    when that bucket's spec class can `merge` it (e.g. full attention with and without
    a recorded sliding window)."""
    same_spec: dict = defaultdict(list)
    for name, spec in specs.items():
        same_spec[spec].append(name)
    layer_buckets: list[list[str]] = []
    merged: list[list] = []
    for spec, names in same_spec.items():
        for layers, bucket_specs in zip(layer_buckets, merged):
            try:
                type(bucket_specs[0]).merge([*bucket_specs, spec])
            except (AssertionError, ValueError):  # what vLLM catches: incompatible
                continue
            layers.extend(names)
            bucket_specs.append(spec)
            break
        else:
            layer_buckets.append(list(names))
            merged.append([spec])
    return layer_buckets


def vllm_group_size(buckets: list[list[str]]) -> int:
    """vLLM 0.32.0's group size: the smallest bucket's size, or the largest's when it is
    under 1.5 x the smallest (so 12 + 13 layers make two groups of 13, not 1 + 2 x 12)."""
    sizes = [len(b) for b in buckets]
    return max(sizes) if max(sizes) < min(sizes) * 1.5 else min(sizes)


def split_buckets(buckets: list[list[str]], group_size: int) -> list[list[str]]:
    """vLLM's split, restated: each bucket of n layers into cdiv(n, G) groups,
    bucket[i::cdiv(n, G)]. E.g. G = 2, buckets (f0, f1), (s0, s1, s2) ->
    (f0, f1), (s0, s2), (s1) (the last one padded)."""
    groups = []
    for layers in buckets:
        n = _cdiv(len(layers), group_size)
        groups += [layers[i::n] for i in range(n)]
    return groups


def window_covers(sliding_window: int | None, max_model_len: int) -> bool:
    """Whether a draft window covers `max_model_len` (no window: it covers everything).
    Where it does not, the plan keeps the draft's sliding-window KV spec (blocks behind
    the window freed); where it does, the draft's K/V holds every position
    (`promote_draft`, or a window no block ever leaves). `model/memory.py` counts the
    draft K/V by the same rule."""
    return sliding_window is None or sliding_window >= max_model_len


def promote_draft(specs: dict, draft_layers: frozenset[str],
                  max_model_len: int) -> dict | None:
    """`specs` with the draft's sliding-window layers allocated as full attention (vLLM's
    `FullAttentionSpec` with the window recorded, as vLLM's own promotion writes it) when
    their window covers `max_model_len`: no block would ever leave the window, and the
    window's allocation is the larger (by the tokens in flight and a block). None when
    no draft layer has such a spec."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec, replace_as

    windowed = [n for n in specs if n in draft_layers and isinstance(specs[n],
                                                                      SlidingWindowSpec)]
    if not windowed or not all(window_covers(specs[n].sliding_window, max_model_len)
                               for n in windowed):
        return None
    # A promoted spec keeps every block, so the trailing-edge extension is moot.
    return {n: replace_as(s, FullAttentionSpec, drop=("extra_retained_tokens",))
            if n in windowed else s for n, s in specs.items()}


def layer_kind(spec) -> str:
    """What a layer's KV spec keeps: 'state' (GDN / mamba), 'sliding window', 'full
    attention' (a recorded window included: its blocks are all kept)."""
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

    if isinstance(spec, MambaSpec):
        return "state"
    if isinstance(spec, SlidingWindowSpec):
        return "sliding window"
    return "full attention"


@dataclass(frozen=True)
class KVCacheGrouping:
    """One split of the layers into KV cache groups, and what it costs."""

    specs: dict  # layer name -> vLLM KVCacheSpec, as grouped (the draft promoted or not)
    groups: tuple[tuple[str, ...], ...]  # layer names per group
    draft_layers: frozenset[str]
    draft_promoted: bool  # the draft's sliding-window layers allocated as full attention
    bytes_per_request: int  # vLLM's count at max_model_len (all groups, padding included)
    bytes_per_block: int  # one block of the shared pool: a page per slot of a group

    @property
    def group_size(self) -> int:  # G: the slots of every group's block
        return max(len(g) for g in self.groups)

    @property
    def draft_groups(self) -> int:
        """Groups holding draft layers (vLLM's proposer needs exactly 1)."""
        return sum(1 for g in self.groups if self.draft_layers.intersection(g))

    def padding(self) -> dict[str, int]:
        """Unused slots per kind of layer ('target state', 'target full attention',
        'draft sliding window', ...): slots of groups with fewer layers than G."""
        out: dict[str, int] = defaultdict(int)
        for g in self.groups:
            if len(g) < self.group_size:
                out[self.group_label(g)] += self.group_size - len(g)
        return dict(out)

    def group_label(self, group) -> str:
        """'target state', 'draft sliding window', 'target + draft full attention', ..."""
        owners = [o for o, mine in (("target", any(n not in self.draft_layers for n in group)),
                                    ("draft", any(n in self.draft_layers for n in group)))
                  if mine]
        return f"{' + '.join(owners)} {layer_kind(self.specs[group[0]])}"


def _grouping(vllm_config, specs: dict, groups, draft_layers, promoted) -> KVCacheGrouping:
    from vllm.v1.core.kv_cache_utils import (
        _max_memory_usage_bytes_from_groups,
        _pool_bytes_per_block,
        create_kv_cache_group_specs,
    )

    group_specs = create_kv_cache_group_specs(specs, [list(g) for g in groups])
    return KVCacheGrouping(
        specs=specs, groups=tuple(tuple(g) for g in groups), draft_layers=draft_layers,
        draft_promoted=promoted,
        bytes_per_request=_max_memory_usage_bytes_from_groups(vllm_config, group_specs),
        bytes_per_block=_pool_bytes_per_block(vllm_config, group_specs))


def vllm_kv_cache_grouping(vllm_config, specs: dict,
                           draft_layers: frozenset[str]) -> KVCacheGrouping:
    """What vLLM 0.32.0 makes of `specs` (pages already of one size), restated; it may
    split the draft over several groups (then the engine does not start)."""
    buckets = spec_buckets(specs)
    return _grouping(vllm_config, specs, split_buckets(buckets, vllm_group_size(buckets)),
                     frozenset(draft_layers), False)


def _bucketings(specs: dict, draft_layers: frozenset[str]) -> list[list[list[str]]]:
    """vLLM's buckets of `specs`, and, when the draft shares a bucket with target layers
    (equal specs), the same with the draft's layers in a bucket of their own: a group
    of the draft only (a split of that bucket vLLM would not make; groups of one spec
    are all it needs)."""
    buckets = spec_buckets(specs)
    if not any(draft_layers.intersection(b) and not draft_layers.issuperset(b)
               for b in buckets):
        return [buckets]
    apart = [[n for n in b if n not in draft_layers] for b in buckets]
    return [buckets, [b for b in apart if b] + [[n for n in specs if n in draft_layers]]]


def plan_kv_cache_groups(vllm_config, specs: dict,
                         draft_layers: frozenset[str]) -> KVCacheGrouping:
    """DSpine's grouping of `specs` (layer name -> vLLM KVCacheSpec, pages of one size,
    as `_get_kv_cache_groups_uniform_page_size` receives them); see the module docstring.
    `vllm_config` needs what vLLM's memory count reads (`model_config.max_model_len`,
    `cache_config`, `parallel_config`, `scheduler_config`, `max_in_flight_tokens`)."""
    draft_layers = frozenset(draft_layers)
    vllms = vllm_kv_cache_grouping(vllm_config, specs, draft_layers)
    # Sort key: bytes per request, then vLLM's own grouping, then the window kept, then
    # fewer groups.
    best, best_key = (vllms, (vllms.bytes_per_request, 0, 0, len(vllms.groups))) \
        if vllms.draft_groups == 1 else (None, None)
    variants = [(specs, False)]
    promoted = promote_draft(specs, draft_layers, vllm_config.model_config.max_model_len)
    if promoted is not None:
        variants.append((promoted, True))
    for variant, is_promoted in variants:
        seen = set()
        for buckets in _bucketings(variant, draft_layers):
            for group_size in range(1, max(len(b) for b in buckets) + 1):
                groups = tuple(tuple(g) for g in split_buckets(buckets, group_size))
                if groups in seen or \
                        sum(1 for g in groups if draft_layers.intersection(g)) > 1:
                    continue
                seen.add(groups)
                candidate = _grouping(vllm_config, variant, groups, draft_layers,
                                      is_promoted)
                key = (candidate.bytes_per_request,
                       int(groups != vllms.groups or is_promoted), int(is_promoted),
                       len(groups))
                if best_key is None or key < best_key:
                    best, best_key = candidate, key
    # The largest group size leaves every bucket whole, the draft's (kept apart) included.
    assert best is not None, "no KV cache grouping keeps the draft layers together"
    return best


def grouping_structure(g: KVCacheGrouping) -> str:
    """The groups by kind, G, padding and where the draft is, in words (what the
    plugin logs; no byte counts)."""
    kinds: dict[str, list[int]] = defaultdict(list)
    for group in g.groups:
        kinds[g.group_label(group)].append(len(group))
    parts = [f"{k} x {len(sizes)} ({'+'.join(map(str, sizes))} layers)"
             for k, sizes in kinds.items()]
    pad = g.padding()
    return (f"{len(g.groups)} groups of {g.group_size} slots: {', '.join(parts)}; padding "
            f"{', '.join(f'{v} {k}' for k, v in pad.items()) or 'none'}; draft layers in "
            f"{g.draft_groups} group(s)")


def describe_grouping(g: KVCacheGrouping) -> str:
    """`grouping_structure`, the draft's allocation and the bytes per request."""
    return (f"{grouping_structure(g)}"
            f"{'; the draft allocated as full attention' if g.draft_promoted else ''}; "
            f"{g.bytes_per_request:,} B per request at max_model_len")
