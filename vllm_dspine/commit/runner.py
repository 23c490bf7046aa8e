"""The replay commit wired into vLLM 0.32.0's runner, CPU path (docs/hybrid.md).

Active only for a DSpine draft on a Qwen3.5 / Qwen3-Next text target (the `gdn-*` patches in
`plugin/patches/gdn_commit.py` mark each GDN layer with `_dspine_replay = True` and give it one
state slot with a W - 1 conv window, no speculative slots). Per step:

1. Verify forward (`gdn_core_cpu`, in place of vLLM's CPU GDN core for marked layers).
   Spec rows (vLLM's `spec_sequence_masks`: a decode with >= 0 drafts) of one token (no
   drafts: its one position is always committed) run through vLLM's own decode path,
   which updates their slot in place: the arithmetic of plain decoding. Spec rows with
   drafts run as chunks from their slot's state on *scratch* copies, through vLLM's own
   CPU ops (the C++ causal conv with initial state, and the CPU speculative recurrent
   kernel with every position's state index pointing at the scratch row), so every
   position gets its output and the pool keeps the checkpoint (the state before the
   block). The layer keeps the block's pre-conv `mixed_qkv`, `a`, `b`, the rows' slots,
   `spec_query_start_loc` and the scratch state after the whole block for step 2. Prompt
   chunks (non-spec rows) run through vLLM's unchanged non-speculative path, which writes
   their final state as usual.
2. Commit (`commit_step`, from `GPUModelRunner._update_states_after_model_execute` after
   sampling): with vLLM's accepted counts (`(output_token_ids != -1).sum(1)`: accepted
   drafts + 1), a row whose whole block was accepted takes the scratch state after its
   block (what the verify forward computed for exactly those tokens); `gdn_replay`
   rebuilds every other row's slot through exactly its accepted prefix, in place. vLLM's
   `num_accepted_tokens` are then set to 1: the committed state is in the request's only
   slot, with no offset for any later reader.

With prefix caching (vLLM's mamba cache mode 'align') the slot is the request's running
block, which vLLM's `preprocess_mamba` moves from block to block before the forward; a
commit whose accepted prefix crosses a block boundary first stores the boundary state in
the boundary block (`BoundaryStores`).

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
    """What one GDN layer keeps from a verify forward until the commit of that step: the
    spec rows with drafts (one-token rows were committed by the forward itself)."""

    inputs: VerifiedBlockInputs  # the rows' tokens, in spec-row order
    slots: torch.Tensor  # [n] int64 state slot of each row
    batch_rows: torch.Tensor  # [n] int64 the row of each row in the input batch
    block_windows: torch.Tensor  # [n, D, W-1] conv window after each row's whole block
    block_states: torch.Tensor  # [n, HV, K, V] recurrent state after its whole block


def replay_active(vllm_config) -> bool:
    """Whether the replay commit is in charge of this engine's GDN state: a DSpine draft
    on a Qwen3.5 / Qwen3-Next text target, on CPU (the validation refuses every other
    hybrid target, and hybrid targets on CUDA, at start)."""
    from vllm.platforms import current_platform

    from vllm_dspine.hf_config import is_dspine_draft

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


def _drafted_rows_forward(layer, qsl: torch.Tensor, slots: torch.Tensor,
                          mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GDN core outputs [n_tokens, HV, V] of n spec rows (tokens in row order, rows
    starting at qsl [n + 1]) from their slots' states, writing nothing to the pools; with
    the conv windows [n, D, W-1] and recurrent states [n, HV, K, V] after each whole row."""
    import vllm._custom_ops as ops
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as cpu_gdn

    n = slots.shape[0]
    qsl = qsl.to(torch.int32)
    conv_pool, ssm_pool = _pools(layer)
    width = int((qsl[1:] - qsl[:-1]).max())

    # Conv, as vLLM's non-speculative prefill runs it, on a copy of the windows (the
    # kernels leave the window after the row's last token in it).
    use_cpp_conv = torch.cpu._is_avx512_bf16_supported() or cpu_gdn.is_arm_bf16()
    scratch_windows = conv_pool.index_select(0, slots)  # [n, D, W-1], a copy
    ones = torch.ones(n, dtype=torch.bool)
    rows = torch.arange(n, dtype=torch.int32)
    x = mixed_qkv.contiguous()
    silu = layer.activation == "silu"
    if use_cpp_conv:
        # The C++ kernels read the window through its [.., W-1, D] storage, as the pool's.
        scratch_windows = scratch_windows.transpose(1, 2).contiguous().transpose(1, 2)
        conv_out = ops.causal_conv1d_fwd_cpu(
            x=x.transpose(0, 1), weight=layer.conv1d.weight, bias=layer.conv1d.bias,
            conv_states=scratch_windows, query_start_loc=qsl, cache_indices=rows,
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
    # every column names the row's scratch slot (1 + row; slot 0 is left unused), which
    # therefore ends at the state after the whole row.
    q, k, v = layer.rearrange_mixed_qkv(conv_out.contiguous())
    scratch = torch.empty((n + 1, *ssm_pool.shape[1:]), dtype=ssm_pool.dtype)
    scratch[1:] = ssm_pool.index_select(0, slots)
    indices = (rows + 1)[:, None].expand(n, width).contiguous()
    out = ops.fused_sigmoid_gating_delta_rule_update_spec_cpu(
        A_log=layer.A_log, dt_bias=layer.dt_bias, q=q.squeeze(0), k=k.squeeze(0),
        v=v.squeeze(0), a=a.contiguous(), b=b.contiguous(), initial_state_source=scratch,
        spec_state_indices=indices, num_accepted_tokens=torch.ones(n, dtype=torch.int32),
        cu_seqlens=qsl.contiguous(), use_qk_l2norm_in_kernel=True)
    return out, scratch_windows, scratch[1:]


def _as_decodes(md, slots: torch.Tensor):
    """vLLM's metadata for running `slots` as plain one-token decodes (no speculation)."""
    n = slots.shape[0]
    return dataclasses.replace(
        md, spec_sequence_masks=None, num_accepted_tokens=None, num_decodes=n,
        num_decode_tokens=n, num_prefills=0, num_prefill_tokens=0,
        non_spec_state_indices_tensor=slots,
        non_spec_query_start_loc=torch.arange(n + 1, dtype=torch.int32))


def gdn_core_cpu(original_nonspec, layer, md, mixed_qkv, b, a, core_attn_out) -> None:
    """In place of vLLM's `_cpu_gdn_attention_nonspec` for a marked layer (the conv
    window is W - 1, so vLLM's CPU core always lands there): one-token spec rows as
    vLLM's decodes, drafted spec rows through `_drafted_rows_forward` (recorded for the
    commit), the rest through vLLM's path."""
    masks_cpu = md.spec_sequence_masks_cpu
    if md.spec_sequence_masks is None or masks_cpu is None or md.num_spec_decodes == 0:
        layer._dspine_step = None
        return original_nonspec(layer, md, mixed_qkv, b, a, core_attn_out)
    n = md.num_spec_decodes
    qsl = md.spec_query_start_loc[: n + 1].long()
    num_spec_tokens = int(qsl[n])
    if md.num_prefills == 0 and md.num_decodes == 0:  # spec rows only: tokens 0 ..
        idx = None
        x_s, a_s, b_s = (t[:num_spec_tokens] for t in (mixed_qkv, a, b))
    else:
        idx = md.spec_token_indx.long()
        x_s, a_s, b_s = (t.index_select(0, idx) for t in (mixed_qkv, a, b))
    slots = md.spec_state_indices_tensor[:n, 0]
    lens = qsl[1:] - qsl[:-1]
    single = lens == 1
    out = torch.empty((num_spec_tokens, *core_attn_out.shape[1:]), dtype=core_attn_out.dtype)
    if bool(single.any()):
        # No drafts: the one position is committed whatever is sampled, so the slot is
        # advanced now, by plain decoding's own kernels.
        tok = qsl[:-1][single]
        one_out = torch.empty((tok.shape[0], *core_attn_out.shape[1:]), dtype=out.dtype)
        original_nonspec(layer, _as_decodes(md, slots[single].contiguous()),
                         x_s.index_select(0, tok), b_s.index_select(0, tok),
                         a_s.index_select(0, tok), one_out)
        out.index_copy_(0, tok, one_out)
    layer._dspine_step = None
    drafted = (~single).nonzero().flatten()
    if drafted.numel() > 0:
        row_of_token = torch.repeat_interleave(torch.arange(n), lens)
        tok = (~single)[row_of_token].nonzero().flatten()
        d_qsl = torch.zeros(drafted.numel() + 1, dtype=torch.long)
        d_qsl[1:] = lens[drafted].cumsum(0)
        x_d, a_d, b_d = (t.index_select(0, tok) for t in (x_s, a_s, b_s))
        d_slots = slots[drafted].long()
        d_out, windows, states = _drafted_rows_forward(layer, d_qsl, d_slots, x_d, b_d, a_d)
        out.index_copy_(0, tok, d_out.to(out.dtype))
        batch_rows = masks_cpu.nonzero().flatten()[:n].long()[drafted]
        layer._dspine_step = StepRecord(
            inputs=VerifiedBlockInputs(mixed_qkv=x_d.clone(), a=a_d.clone(), b=b_d.clone(),
                                       query_start_loc=d_qsl),
            slots=d_slots, batch_rows=batch_rows, block_windows=windows,
            block_states=states)
    if idx is None:
        core_attn_out[:num_spec_tokens] = out
        return
    core_attn_out.index_copy_(0, idx, out)
    ns_idx = md.non_spec_token_indx
    ns_idx = ns_idx.long() if ns_idx is not None else None
    if ns_idx is not None and ns_idx.numel() > 0:
        # vLLM's builder already made prefill metadata for the non-spec subset (decodes
        # reclassified as one-token prefills); run it as a batch without speculation.
        ns_md = dataclasses.replace(md, spec_sequence_masks=None, num_accepted_tokens=None)
        ns_out = torch.zeros((ns_idx.numel(), *core_attn_out.shape[1:]),
                             dtype=core_attn_out.dtype)
        original_nonspec(layer, ns_md, mixed_qkv.index_select(0, ns_idx),
                         b.index_select(0, ns_idx), a.index_select(0, ns_idx), ns_out)
        core_attn_out.index_copy_(0, ns_idx, ns_out)


@dataclasses.dataclass
class BoundaryStores:
    """Prefix caching (vLLM's 'align' mamba cache mode): the drafted rows of a step whose
    accepted prefix crosses a mamba block boundary that the running slot does not hold.

    vLLM caches the state after (k + 1) * block_size tokens in the request's block k and
    keeps the running state in block `(seq_len - 1) // block_size` (`preprocess_mamba`,
    `mamba_get_block_table_tensor`). A verified block of positions c .. c + len - 1
    (c tokens computed before it) whose commit ends at c + count crosses the boundary
    B = (c + count) // block_size * block_size when c < B; block B / block_size - 1 then
    needs the state after B - c of the block's positions. When that block is the running
    one (B = c + len, the whole block accepted) the commit itself writes it."""

    counts: torch.Tensor  # [n] int64, over the record's rows: positions to replay into
    #                       the boundary block (0: the row stores nothing)
    slots: torch.Tensor  # [n] int64 the boundary block's slot (the row's own where none)


def _mamba_group_of_layers(runner) -> dict[str, int]:
    from vllm.v1.kv_cache_interface import MambaSpec

    groups = {}
    for gid, group in enumerate(runner.kv_cache_config.kv_cache_groups):
        if isinstance(group.kv_cache_spec, MambaSpec):
            groups.update({name: gid for name in group.layer_names})
    return groups


def mamba_group(runner, layer_name: str) -> int:
    """The KV cache group of a GDN layer (its block ids in `req_state.block_ids`)."""
    groups = getattr(runner, "_dspine_mamba_groups", None)
    if groups is None:
        groups = runner._dspine_mamba_groups = _mamba_group_of_layers(runner)
    return groups[layer_name]


def boundary_stores(runner, gid: int, rec: StepRecord,
                    n_acc: torch.Tensor) -> BoundaryStores | None:
    """The boundary stores of a step's recorded rows in mamba group `gid` (None if none;
    the same for every layer of the group: they verify the same rows)."""
    block_size = runner.kv_cache_config.kv_cache_groups[gid].kv_cache_spec.block_size
    qsl = rec.inputs.query_start_loc
    lens = (qsl[1:] - qsl[:-1]).tolist()
    counts = torch.zeros_like(rec.slots)
    slots = rec.slots.clone()
    req_ids = runner.input_batch.req_ids
    for i, (row, count) in enumerate(zip(rec.batch_rows.tolist(), n_acc.tolist())):
        req_id = req_ids[row]
        req = runner.requests[req_id]
        c = req.num_computed_tokens  # before this step (updated at the next step's start)
        boundary = (c + count) // block_size * block_size
        if boundary <= c:
            continue
        running = runner.mamba_state_idx[req_id]
        if running != (c + lens[i] - 1) // block_size:
            raise RuntimeError(f"vllm-dspine: request {req_id!r} keeps its running mamba "
                               f"state in block {running}, not in the block of its last "
                               f"verified position ({c + lens[i] - 1}): vLLM's align-mode "
                               f"bookkeeping changed; serve with --no-enable-prefix-caching")
        dest = boundary // block_size - 1
        if dest == running:
            continue
        counts[i] = boundary - c
        slots[i] = req.block_ids[gid][dest]
    if not bool((counts > 0).any()):
        return None
    return BoundaryStores(counts=counts, slots=slots)


def commit_step(runner, output_token_ids: torch.Tensor) -> int:
    """The commit of one step: in every marked layer, each recorded (drafted) spec row
    whose whole block was accepted takes the verify forward's state after the block; the
    others are replayed through their accepted prefix. With prefix caching, a row whose
    commit crosses a mamba block boundary first stores the boundary state in that block
    (`BoundaryStores`). Returns the number of layers committed."""
    counts = (output_token_ids != -1).sum(dim=1).cpu()
    align = runner.cache_config.mamba_cache_mode == "align"
    stores_of_group: dict[int, BoundaryStores | None] = {}
    done = 0
    for name, layer in runner.compilation_config.static_forward_context.items():
        rec = getattr(layer, "_dspine_step", None)
        if rec is None or not getattr(layer, "_dspine_replay", False):
            continue
        layer._dspine_step = None
        conv_pool, ssm_pool = _pools(layer)
        n_acc = counts.index_select(0, rec.batch_rows).long()
        qsl = rec.inputs.query_start_loc
        stores = None
        if align:
            gid = mamba_group(runner, name)
            if gid not in stores_of_group:
                stores_of_group[gid] = boundary_stores(runner, gid, rec, n_acc)
            stores = stores_of_group[gid]
        if stores is not None:
            # First the boundary block: the checkpoint (still in the running slot) copied
            # there, then replayed through the positions up to the boundary.
            rows = stores.counts > 0
            conv_pool[stores.slots[rows]] = conv_pool[rec.slots[rows]]
            ssm_pool[stores.slots[rows]] = ssm_pool[rec.slots[rows]]
            gdn_replay(ssm_pool.transpose(-1, -2), conv_pool, rec.inputs, stores.counts,
                       gdn_weights(layer), state_indices=stores.slots)
        whole = n_acc == qsl[1:] - qsl[:-1]
        if bool(whole.any()):
            conv_pool[rec.slots[whole]] = rec.block_windows[whole]
            ssm_pool[rec.slots[whole]] = rec.block_states[whole]
        if not bool(whole.all()):
            # Rows taken whole count 0 here: the replay leaves their slots as they are.
            gdn_replay(ssm_pool.transpose(-1, -2), conv_pool, rec.inputs,
                       torch.where(whole, 0, n_acc), gdn_weights(layer),
                       state_indices=rec.slots)
        done += 1
    return done
