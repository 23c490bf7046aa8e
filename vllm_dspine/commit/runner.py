"""The replay commit wired into vLLM 0.32.0's runner, CPU path (docs/hybrid.md).

Active only for a DSpine draft on a Qwen3.5 / Qwen3-Next text target (the patches in
`plugin/patches.py` mark each GDN layer with `_dspine_replay = True` and give it one
state slot with a W - 1 conv window, no speculative slots). Per step:

1. Verify forward (`gdn_core_cpu`, in place of vLLM's CPU GDN core for marked layers):
   rows that are speculative decodes (vLLM's `spec_sequence_masks`: a decode with >= 0
   drafts) run as chunks from their slot's state on *scratch* copies, through vLLM's own
   CPU ops (the C++ causal conv with initial state, and the CPU speculative recurrent
   kernel with every position's state index pointing at the scratch row), so every
   position gets its output and the pool keeps the checkpoint (the state before the
   block). The layer keeps the block's pre-conv `mixed_qkv`, `a`, `b`, the rows' slots
   and `spec_query_start_loc` for step 2. Prompt chunks (non-spec rows) run through
   vLLM's unchanged non-speculative path, which writes their final state as usual.
2. Commit (`commit_step`, from `GPUModelRunner._update_states_after_model_execute` after
   sampling): with vLLM's accepted counts (`(output_token_ids != -1).sum(1)`: accepted
   drafts + 1), `gdn_replay` rebuilds each spec row's slot through exactly its accepted
   prefix, in place. vLLM's `num_accepted_tokens` are then set to 1: the committed state
   is in the request's only slot, with no offset for any later reader.

Nothing is kept across steps: a request preempted between steps loses its slot and
re-prefills as a non-spec row.
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_dspine.commit.gdn_ref import GDNWeights, VerifiedBlockInputs
from vllm_dspine.commit.replay import gdn_replay

# Architectures whose linear-attention layers are vLLM's QwenGatedDeltaNetAttention and
# whose `get_mamba_state_shape_from_config` the patches cover.
GDN_TARGET_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                            "Qwen3NextForCausalLM")


@dataclasses.dataclass
class StepRecord:
    """What one GDN layer keeps from a verify forward until the commit of that step."""

    inputs: VerifiedBlockInputs  # the spec rows' tokens, in spec-row order
    slots: torch.Tensor  # [n] int64 state slot of each spec row
    batch_rows: torch.Tensor  # [n] int64 the row of each spec row in the input batch


def replay_active(vllm_config) -> bool:
    """Whether the replay commit is in charge of this engine's GDN state: a DSpine draft
    on a Qwen3.5 / Qwen3-Next text target, on CPU (the validation refuses every other
    hybrid target, and hybrid targets on CUDA, at start)."""
    from vllm.platforms import current_platform

    from vllm_dspine.plugin.hf_config import is_dspine_draft

    if vllm_config is None or not is_dspine_draft(vllm_config.speculative_config):
        return False
    if not current_platform.is_cpu():
        return False  # the CUDA verify forward is not wired (validation refuses it)
    model_config = vllm_config.model_config
    archs = getattr(model_config, "architectures", None) or []
    return bool(model_config.is_hybrid) and any(a in GDN_TARGET_ARCHITECTURES for a in archs)


def gdn_weights(layer) -> GDNWeights:
    """The replay's view of a vLLM QwenGatedDeltaNetAttention layer's parameters (its
    conv weight unpacked: on CPUs with AVX-512 BF16 vLLM packs it at load and keeps the
    plain copy as `_cpu_unpacked_conv_weight`)."""
    weight = getattr(layer.conv1d, "_cpu_unpacked_conv_weight", None)
    if weight is None:
        weight = layer.conv1d.weight
        weight = weight.view(weight.size(0), weight.size(-1))
    return GDNWeights(conv_weight=weight, conv_bias=layer.conv1d.bias, A_log=layer.A_log,
                      dt_bias=layer.dt_bias, num_k_heads=layer.num_k_heads // layer.tp_size,
                      head_k_dim=layer.head_k_dim, head_v_dim=layer.head_v_dim,
                      activation=layer.activation)


def _pools(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """(conv pool as [slots, D, W-1], recurrent pool as vLLM's CPU kernels read it,
    [slots, HV, K, V]) - views of the layer's KV cache."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    conv = layer.kv_cache[0]
    if not is_conv_state_dim_first():
        conv = conv.transpose(-1, -2)
    ssm = layer.kv_cache[1]
    n, hv, v, k = ssm.shape
    return conv, ssm.view(n, hv, k, v)


def _spec_rows_forward(layer, md, mixed_qkv: torch.Tensor, b: torch.Tensor,
                       a: torch.Tensor) -> torch.Tensor:
    """GDN core outputs [n_tokens, HV, V] of the spec rows, from their slots' states,
    writing nothing to the pools. Tokens in spec-row order (`spec_query_start_loc`)."""
    import vllm._custom_ops as ops
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as cpu_gdn

    n = md.num_spec_decodes
    qsl = md.spec_query_start_loc[: n + 1].to(torch.int32)
    slots = md.spec_state_indices_tensor[:n, 0].long()
    conv_pool, ssm_pool = _pools(layer)
    lens = qsl[1:] - qsl[:-1]
    width = int(lens.max()) if n > 0 else 0

    # Conv, as vLLM's non-speculative prefill runs it, on a copy of the windows.
    use_cpp_conv = torch.cpu._is_avx512_bf16_supported() or cpu_gdn.is_arm_bf16()
    scratch_windows = conv_pool.index_select(0, slots)  # [n, D, W-1], a copy
    ones = torch.ones(n, dtype=torch.bool)
    rows = torch.arange(n, dtype=torch.int32)
    x = mixed_qkv.contiguous()
    silu = layer.activation == "silu"
    if use_cpp_conv:
        # The C++ kernels read the window through its [.., W-1, D] storage, as the pool's.
        storage = scratch_windows.transpose(1, 2).contiguous().transpose(1, 2)
        if x.shape[0] == 1:
            # One token in all: the prefill kernel refuses a [D, 1] x (it wants a
            # transposed, non-contiguous view); vLLM's decode conv is the same
            # arithmetic for one position.
            conv_out = ops.causal_conv1d_update_cpu(
                x=x, conv_states=storage, weight=layer.conv1d.weight,
                bias=layer.conv1d.bias, silu_activation=silu, conv_state_indices=rows,
                is_weight_packed=True)
        else:
            conv_out = ops.causal_conv1d_fwd_cpu(
                x=x.transpose(0, 1), weight=layer.conv1d.weight, bias=layer.conv1d.bias,
                conv_states=storage, query_start_loc=qsl, cache_indices=rows,
                has_initial_state=ones, silu_activation=silu,
                is_weight_packed=True).transpose(0, 1)
    else:
        conv_out = cpu_gdn.causal_conv1d_torch(
            x=x.transpose(0, 1), weight=cpu_gdn._unpacked_conv_weight(layer),
            bias=layer.conv1d.bias, conv_states=scratch_windows, query_start_loc=qsl,
            cache_indices=rows, has_initial_state=ones,
            activation=layer.activation).transpose(0, 1)

    # Recurrence: vLLM's CPU speculative kernel on scratch states. It resumes from
    # column num_accepted - 1 (= 0) and writes the state after position t to column t;
    # every column names the row's scratch slot (1 + row; slot 0 is left unused).
    q, k, v = layer.rearrange_mixed_qkv(conv_out.contiguous())
    scratch = torch.empty((n + 1, *ssm_pool.shape[1:]), dtype=ssm_pool.dtype)
    scratch[1:] = ssm_pool.index_select(0, slots)
    indices = (rows + 1)[:, None].expand(n, max(width, 1)).contiguous()
    return ops.fused_sigmoid_gating_delta_rule_update_spec_cpu(
        A_log=layer.A_log, dt_bias=layer.dt_bias, q=q.squeeze(0), k=k.squeeze(0),
        v=v.squeeze(0), a=a.contiguous(), b=b.contiguous(), initial_state_source=scratch,
        spec_state_indices=indices, num_accepted_tokens=torch.ones(n, dtype=torch.int32),
        cu_seqlens=qsl.contiguous(), use_qk_l2norm_in_kernel=True)


def gdn_core_cpu(original_nonspec, layer, md, mixed_qkv, b, a, core_attn_out) -> None:
    """In place of vLLM's `_cpu_gdn_attention_nonspec` for a marked layer (the conv
    window is W - 1, so vLLM's CPU core always lands there): spec rows through
    `_spec_rows_forward` (recorded for the commit), the rest through vLLM's path."""
    masks_cpu = md.spec_sequence_masks_cpu
    if md.spec_sequence_masks is None or masks_cpu is None or md.num_spec_decodes == 0:
        layer._dspine_step = None
        return original_nonspec(layer, md, mixed_qkv, b, a, core_attn_out)
    n = md.num_spec_decodes
    only_spec = md.num_prefills == 0 and md.num_decodes == 0
    if only_spec:
        num_spec_tokens = int(md.spec_query_start_loc[n])
        idx = None
        x_s, a_s, b_s = (t[:num_spec_tokens] for t in (mixed_qkv, a, b))
    else:
        idx = md.spec_token_indx.long()
        x_s, a_s, b_s = (t.index_select(0, idx) for t in (mixed_qkv, a, b))
    out = _spec_rows_forward(layer, md, x_s, b_s, a_s)
    if idx is None:
        core_attn_out[: out.shape[0]] = out
    else:
        core_attn_out.index_copy_(0, idx, out.to(core_attn_out.dtype))
        ns_idx = md.non_spec_token_indx
        ns_idx = ns_idx.long() if ns_idx is not None else None
        if ns_idx is not None and ns_idx.numel() > 0:
            # vLLM's builder already made prefill metadata for the non-spec subset
            # (decodes reclassified as one-token prefills); run it as a batch without
            # speculation.
            ns_md = dataclasses.replace(md, spec_sequence_masks=None,
                                        num_accepted_tokens=None)
            ns_out = torch.zeros((ns_idx.numel(), *core_attn_out.shape[1:]),
                                 dtype=core_attn_out.dtype)
            original_nonspec(layer, ns_md, mixed_qkv.index_select(0, ns_idx),
                             b.index_select(0, ns_idx), a.index_select(0, ns_idx), ns_out)
            core_attn_out.index_copy_(0, ns_idx, ns_out)
    batch_rows = masks_cpu.nonzero().flatten()[:n].long()
    layer._dspine_step = StepRecord(
        inputs=VerifiedBlockInputs(mixed_qkv=x_s.clone(), a=a_s.clone(), b=b_s.clone(),
                                   query_start_loc=md.spec_query_start_loc[: n + 1].long()),
        slots=md.spec_state_indices_tensor[:n, 0].long().clone(), batch_rows=batch_rows)


def marked_layers(forward_context: dict) -> list:
    return [layer for layer in forward_context.values()
            if getattr(layer, "_dspine_replay", False)]


def commit_step(runner, output_token_ids: torch.Tensor) -> int:
    """The commit of one step: every marked layer's recorded spec rows are replayed
    through their accepted prefix. Returns the number of layers committed."""
    counts = (output_token_ids != -1).sum(dim=1)
    done = 0
    for layer in marked_layers(runner.compilation_config.static_forward_context):
        rec = getattr(layer, "_dspine_step", None)
        if rec is None:
            continue
        layer._dspine_step = None
        conv_pool, ssm_pool = _pools(layer)
        n_acc = counts.index_select(0, rec.batch_rows.to(counts.device)).long()
        gdn_replay(ssm_pool.transpose(-1, -2), conv_pool, rec.inputs, n_acc.cpu(),
                   gdn_weights(layer), state_indices=rec.slots)
        done += 1
    return done
