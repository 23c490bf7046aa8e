"""vLLM's KV cache grouping: row `dspine-kv-cache-groups` of table.py. The choice of
groups is `vllm_dspine/model/kv_cache_groups.py` (`plan_kv_cache_groups`); this module
only puts it where vLLM groups a model whose layers do not all share one KV spec."""

from __future__ import annotations

import contextvars
import functools

from vllm_dspine.plugin.patches.guard import is_applied, mark_applied

# The grouping to use inside one `get_kv_cache_groups` call of an engine with a DSpine
# draft: (vllm_config, draft layer names), set by the outer wrapper for the inner one.
_DSPINE_GROUPING: contextvars.ContextVar = contextvars.ContextVar("dspine_kv_cache_grouping",
                                                                  default=None)


def draft_layer_names(vllm_config, kv_cache_spec: dict) -> frozenset[str]:
    """The draft's KV layers: vLLM numbers the DFlash drafter's layers after the target's
    (`DFlashQwen3ForCausalLM`: start_layer_id = the target's layer count)."""
    from vllm.model_executor.models.utils import extract_layer_index

    from vllm_dspine.hf_config import dspine_config_of

    first = vllm_config.model_config.get_total_num_hidden_layers()
    names = frozenset(n for n in kv_cache_spec if extract_layer_index(n) >= first)
    expected = dspine_config_of(
        vllm_config.speculative_config.draft_model_config.hf_config).num_hidden_layers
    if len(names) != expected:
        raise RuntimeError(
            f"vllm-dspine: expected the drafter's {expected} KV cache layers numbered from "
            f"{first} (after the target's), found {sorted(names)} among "
            f"{sorted(kv_cache_spec)}")
    return names


def check_draft_in_one_group(groups, draft_layers: frozenset[str]) -> None:
    """vLLM's proposer drafts through one KV cache group (its
    `validate_same_kv_cache_group` would fail later with a bare assert). DSpine's
    grouping always keeps the draft together; vLLM's other paths (pages of different
    sizes in a block-outermost layout, a GPU case) are not regrouped."""
    holding = [list(g.layer_names) for g in groups if draft_layers.intersection(g.layer_names)]
    if len(holding) > 1:
        raise ValueError(
            f"vllm-dspine: vLLM put the drafter's KV cache layers in {len(holding)} KV cache "
            f"groups ({holding}), but its proposer drafts through one. DSpine regroups "
            f"layers whose KV pages have one size (patch row dspine-kv-cache-groups, "
            f"docs/hybrid.md); this model's pages differ in size. Serve a drafter whose "
            f"config.json has \"sliding_window\": null, or whose KV heads and head_dim "
            f"match the target's")


def patch_kv_cache_groups() -> None:
    from vllm.logger import init_logger
    from vllm.v1.core import kv_cache_utils

    logger = init_logger("vllm.dspine.kv_cache_groups")  # under "vllm": every process
    outer = kv_cache_utils.get_kv_cache_groups
    inner = kv_cache_utils._get_kv_cache_groups_uniform_page_size
    if is_applied(outer, "dspine-kv-cache-groups"):
        return

    @functools.wraps(outer)
    def get_kv_cache_groups(vllm_config, kv_cache_spec):
        from vllm_dspine.hf_config import is_dspine_draft

        if not is_dspine_draft(vllm_config.speculative_config):
            return outer(vllm_config, kv_cache_spec)
        draft_layers = draft_layer_names(vllm_config, kv_cache_spec)
        token = _DSPINE_GROUPING.set((vllm_config, draft_layers))
        try:
            groups = outer(vllm_config, kv_cache_spec)
        finally:
            _DSPINE_GROUPING.reset(token)
        check_draft_in_one_group(groups, draft_layers)
        return groups

    @functools.wraps(inner)
    def _get_kv_cache_groups_uniform_page_size(kv_cache_spec):
        context = _DSPINE_GROUPING.get()
        if context is None:
            return inner(kv_cache_spec)
        from vllm_dspine.model.kv_cache_groups import (
            describe_grouping,
            plan_kv_cache_groups,
            vllm_kv_cache_grouping,
        )

        vllm_config, draft_layers = context
        ours = plan_kv_cache_groups(vllm_config, kv_cache_spec, draft_layers)
        vllms = vllm_kv_cache_grouping(vllm_config, kv_cache_spec, draft_layers)
        if ours.groups != vllms.groups:
            logger.info("vllm-dspine KV cache groups: %s (vLLM's own: %s)",
                        describe_grouping(ours), describe_grouping(vllms))
        return kv_cache_utils.create_kv_cache_group_specs(
            ours.specs, [list(g) for g in ours.groups])

    mark_applied(_get_kv_cache_groups_uniform_page_size, "dspine-kv-cache-groups")
    kv_cache_utils._get_kv_cache_groups_uniform_page_size = \
        _get_kv_cache_groups_uniform_page_size
    kv_cache_utils.get_kv_cache_groups = mark_applied(get_kv_cache_groups,
                                                      "dspine-kv-cache-groups")
