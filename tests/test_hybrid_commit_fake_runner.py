"""The replay commit's runner integration without an engine: `commit/runner.py` on
vLLM's own CPU GDN ops, with a fake GDN layer in vLLM's CPU layout (the verify forward
keeps the drafted rows' checkpoints, the commit replays exactly the accepted prefix, and
in prefix-caching mode stores block-boundary states)."""

from __future__ import annotations

import pytest
import torch

from hybrid_fixtures import offline  # noqa: F401 - autouse: no model hub


class _FakeGDNLayer:
    """What `commit/runner.py` reads of vLLM's QwenGatedDeltaNetAttention: parameters
    and the KV-cache pools in vLLM's CPU layout (conv SD [slots, W-1, D], recurrent
    [slots, HV, V, K] read by the CPU kernels as [slots, HV, K, V]), the conv weight
    packed as vLLM packs it on AVX-512 BF16 CPUs."""

    def __init__(self, H, HV, K, V, W, slots, gen):
        import types

        import vllm._custom_ops as ops

        bf = torch.bfloat16
        self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim = H, HV, K, V
        self.tp_size, self.activation = 1, "silu"
        self.key_dim, self.value_dim = H * K, HV * V
        D = 2 * H * K + HV * V
        unpacked = (torch.randn(D, W, generator=gen) * W ** -0.5).to(bf)
        self.conv1d = types.SimpleNamespace(bias=None, _cpu_unpacked_conv_weight=unpacked)
        if torch.cpu._is_avx512_bf16_supported():
            self.conv1d.weight = ops.causal_conv1d_weight_pack(unpacked.clone())
        else:
            self.conv1d.weight = unpacked.view(D, 1, W).clone()
            del self.conv1d._cpu_unpacked_conv_weight
        self.A_log = (0.1 + 0.4 * torch.rand(HV, generator=gen)).log()
        self.dt_bias = (torch.randn(HV, generator=gen) * 0.5).to(bf)
        self.kv_cache = (torch.zeros(slots, W - 1, D, dtype=bf),
                         torch.zeros(slots, HV, V, K, dtype=torch.float32))
        self._dspine_replay = True
        self._dspine_step = None

    def rearrange_mixed_qkv(self, mixed_qkv):
        from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
            QwenGatedDeltaNetAttention,
        )

        return QwenGatedDeltaNetAttention.rearrange_mixed_qkv(self, mixed_qkv)

    def weights(self):
        from vllm_dspine.commit.runner import gdn_weights

        return gdn_weights(self)

    def state(self, slot):
        """(recurrent state in the replay's [HV, V, K] convention, window [D, W-1])."""
        n, hv, v, k = self.kv_cache[1].shape
        return (self.kv_cache[1].view(n, hv, k, v)[slot].transpose(-1, -2).clone(),
                self.kv_cache[0][slot].T.clone())


def _gdn_metadata(spec_lens, spec_slots, prefill_len=0, prefill_slot=None):
    """GDNAttentionMetadata as vLLM's builder makes it for spec rows first, then (when
    prefill_len) one prompt chunk without prior state."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    n = len(spec_lens)
    i32 = torch.int32
    qsl = torch.tensor([0, *torch.tensor(spec_lens).cumsum(0).tolist()], dtype=i32)
    n_spec = int(qsl[-1])
    masks = torch.tensor([True] * n + ([False] if prefill_len else []))
    kw = dict(num_prefills=0, num_prefill_tokens=0, num_decodes=0, num_decode_tokens=0,
              num_spec_decodes=n, num_spec_decode_tokens=n_spec,
              num_actual_tokens=n_spec + prefill_len, spec_query_start_loc=qsl,
              spec_state_indices_tensor=torch.tensor(spec_slots, dtype=i32)[:, None],
              spec_sequence_masks=masks, spec_sequence_masks_cpu=masks,
              spec_token_indx=torch.arange(n_spec, dtype=i32),
              non_spec_token_indx=torch.arange(n_spec, n_spec + prefill_len, dtype=i32),
              num_accepted_tokens=torch.ones(n, dtype=i32))
    if prefill_len:
        kw.update(num_prefills=1, num_prefill_tokens=prefill_len,
                  non_spec_query_start_loc=torch.tensor([0, prefill_len], dtype=i32),
                  non_spec_state_indices_tensor=torch.tensor([prefill_slot], dtype=i32),
                  has_initial_state=torch.tensor([False]),
                  prefill_query_start_loc=torch.tensor([0, prefill_len], dtype=i32),
                  prefill_state_indices=torch.tensor([prefill_slot], dtype=i32),
                  prefill_has_initial_state=torch.tensor([False]))
    return GDNAttentionMetadata(**kw)


def _rel(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm()).item()


def test_runner_verify_keeps_checkpoint_and_commit_replays_accepted_prefix():
    """`commit/runner.py` on vLLM's own CPU GDN ops, as the engine calls it: prompts are
    prefilled through vLLM's unchanged path; a verify step with 4 spec rows (blocks of 16,
    5, 1 and 4 positions) beside a new prompt chunk leaves the drafted rows' slots
    untouched, advances the one-token row's slot (plain decoding: its token is committed
    whatever is sampled), gives every position the output of the recurrence from the
    slot's state, and writes the prompt chunk's state; the commit with counts 11, 2, 1, 4
    then leaves each slot at the recurrence over prefix + exactly that many block tokens
    (the conv window exactly): 11 of 16 and 2 of 5 replayed, 4 of 4 taken from the verify
    forward's state after the block."""
    import dataclasses
    import types

    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as cpu_gdn

    from vllm_dspine.commit.gdn_ref import gdn_forward_ref
    from vllm_dspine.commit.runner import commit_step, gdn_core_cpu
    from vllm_dspine.plugin.patches import apply_patches

    apply_patches()
    original = cpu_gdn._cpu_gdn_attention_nonspec
    original = getattr(original, "__wrapped__", original)  # vLLM's own function
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    H, HV, K, V, W = 1, 2, 128, 128, 4  # vLLM's CPU kernels need head dims 128
    layer = _FakeGDNLayer(H, HV, K, V, W, slots=8, gen=gen)
    w = layer.weights()
    D = w.conv_dim
    bf = torch.bfloat16

    def inputs(n):
        return ((torch.randn(n, D, generator=gen)).to(bf),
                torch.randn(n, HV, generator=gen).to(bf), torch.randn(n, HV, generator=gen).to(bf))

    def prefill(slot, n):
        x, a, b = inputs(n)
        md = _gdn_metadata([], [], prefill_len=n, prefill_slot=slot)
        md = dataclasses.replace(md, spec_sequence_masks=None, spec_sequence_masks_cpu=None,
                                 num_accepted_tokens=None, num_spec_decodes=0)
        out = torch.zeros(n, HV, V, dtype=bf)
        gdn_core_cpu(original, layer, md, x, b, a, out)
        return x, a, b

    slots, lens, counts = [3, 5, 6, 7], [16, 5, 1, 4], [11, 2, 1, 4]
    prefixes = [prefill(s, n) for s, n in zip(slots, (23, 9, 40, 12))]
    before = [layer.state(s) for s in slots]
    # The prefill path itself: slot state = recurrence from zeros (bf16 conv rounding of
    # vLLM's C++ conv differs from the reference's in ~0.3 % of the elements by an ulp).
    for (x, a, b), (st, win) in zip(prefixes, before):
        _, ref_st, ref_win = gdn_forward_ref(torch.zeros(HV, V, K), torch.zeros(D, W - 1, dtype=bf),
                                             x, a, b, w)
        assert torch.equal(win, ref_win)
        assert _rel(st, ref_st) < 2e-2

    blocks = [inputs(n) for n in lens]
    px, pa, pb = inputs(7)  # a new prompt chunk (slot 1) in the same step
    x = torch.cat([blk[0] for blk in blocks] + [px])
    a = torch.cat([blk[1] for blk in blocks] + [pa])
    b = torch.cat([blk[2] for blk in blocks] + [pb])
    md = _gdn_metadata(lens, slots, prefill_len=7, prefill_slot=1)
    out = torch.zeros(x.shape[0], HV, V, dtype=bf)
    gdn_core_cpu(original, layer, md, x, b, a, out)

    for s, (st, win), (bx, ba, bb) in zip(slots, before, blocks):
        st2, win2 = layer.state(s)
        if bx.shape[0] > 1:  # the checkpoints of drafted rows, untouched
            assert torch.equal(st, st2) and torch.equal(win, win2)
        else:  # a row without drafts: advanced by its one token
            _, ref_st, ref_win = gdn_forward_ref(st, win, bx, ba, bb, w)
            assert torch.equal(win2, ref_win) and _rel(st2, ref_st) < 2e-2
    start = 0
    for (st, win), (bx, ba, bb) in zip(before, blocks):
        o, _, _ = gdn_forward_ref(st, win, bx, ba, bb, w)
        got = out[start:start + bx.shape[0]]
        assert _rel(got, o) < 2e-2, _rel(got, o)
        start += bx.shape[0]
    _, ref_st, ref_win = gdn_forward_ref(torch.zeros(HV, V, K), torch.zeros(D, W - 1, dtype=bf),
                                         px, pa, pb, w)
    st1, win1 = layer.state(1)
    assert torch.equal(win1, ref_win) and _rel(st1, ref_st) < 2e-2
    rec = layer._dspine_step
    assert rec is not None and rec.slots.tolist() == [3, 5, 7]
    assert rec.batch_rows.tolist() == [0, 1, 3]

    # Sampled output as vLLM's rejection sampler lays it out: count valid tokens, -1 after;
    # batch row 4 (the prompt chunk) is not a spec row.
    sampled = torch.full((5, 16), -1, dtype=torch.long)
    for r, c in enumerate(counts + [1]):
        sampled[r, :c] = 7
    runner = types.SimpleNamespace(
        compilation_config=types.SimpleNamespace(
            static_forward_context={"model.layers.0.linear_attn": layer}),
        cache_config=types.SimpleNamespace(mamba_cache_mode="none"))
    assert commit_step(runner, sampled) == 1
    assert layer._dspine_step is None
    for s, (st, win), (bx, ba, bb), c in zip(slots, before, blocks, counts):
        _, ref_st, ref_win = gdn_forward_ref(st, win, bx[:c], ba[:c], bb[:c], w)
        got_st, got_win = layer.state(s)
        assert torch.equal(got_win, ref_win), s
        # Replayed rows: the fp32 reference's arithmetic. Rows committed whole: vLLM's
        # C++ kernels' state (bf16 inputs rounded in their own order), as for prefill.
        tol = 1e-5 if c < bx.shape[0] else 2e-2
        assert _rel(got_st, ref_st) < tol, (s, _rel(got_st, ref_st))
        # A position too few or too many is far off.
        _, off_st, _ = gdn_forward_ref(st, win, bx[:c + 1], ba[:c + 1], bb[:c + 1], w)
        if c < bx.shape[0]:
            assert _rel(got_st, off_st) > 1e-2
        _, short_st, _ = gdn_forward_ref(st, win, bx[:c - 1], ba[:c - 1], bb[:c - 1], w)
        assert _rel(got_st, short_st) > 10 * tol, (s, _rel(got_st, short_st))
    assert commit_step(runner, sampled) == 0  # nothing recorded: nothing to commit


def test_commit_stores_block_boundary_states_for_prefix_caching():
    """Mamba cache mode 'align' (prefix caching): vLLM caches the state after
    (k + 1) * block_size tokens in a request's block k and keeps the running state in the
    block of its last scheduled position. A commit whose accepted prefix crosses a
    boundary inside a drafted block must leave the boundary state in the boundary block
    (here block 0, tokens 0..383) and the committed state in the running block. Four
    rows, block size 384: 378 computed, 10 of 16 accepted (boundary after 6 positions);
    370 computed, 16 of 16 (boundary after 14, running block takes the whole block); 379
    computed, 5 of 5 ending on the boundary (the running block is the boundary block:
    nothing extra); 100 computed, 3 of 16 (no boundary: block 0 untouched)."""
    import types

    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as cpu_gdn
    from vllm.v1.kv_cache_interface import MambaSpec

    from vllm_dspine.commit.gdn_ref import gdn_forward_ref
    from vllm_dspine.commit.runner import boundary_stores, commit_step, gdn_core_cpu
    from vllm_dspine.plugin.patches import apply_patches

    apply_patches()
    original = cpu_gdn._cpu_gdn_attention_nonspec
    original = getattr(original, "__wrapped__", original)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1)
    H, HV, K, V, W = 1, 2, 128, 128, 4
    layer = _FakeGDNLayer(H, HV, K, V, W, slots=12, gen=gen)
    w = layer.weights()
    D = w.conv_dim
    bf = torch.bfloat16
    # A checkpoint in every running slot, and something recognisable in block 0's slots.
    layer.kv_cache[0].copy_(torch.randn(layer.kv_cache[0].shape, generator=gen).to(bf))
    layer.kv_cache[1].copy_(torch.randn(layer.kv_cache[1].shape, generator=gen) * 0.1)
    computed, lens, counts = [378, 370, 379, 100], [16, 16, 5, 16], [10, 16, 5, 3]
    running = [3, 4, 5, 6]  # the slot of each request's running block
    block0 = [9, 10, 5, 11]  # the slot of its block 0 (request 2: the running block)
    before = {s: layer.state(s) for s in set(running + block0)}
    blocks = [(torch.randn(n, D, generator=gen).to(bf), torch.randn(n, HV, generator=gen).to(bf),
               torch.randn(n, HV, generator=gen).to(bf)) for n in lens]
    x, a, b = (torch.cat([blk[i] for blk in blocks]) for i in range(3))
    out = torch.zeros(x.shape[0], HV, V, dtype=bf)
    gdn_core_cpu(original, layer, _gdn_metadata(lens, running), x, b, a, out)

    name = "model.layers.0.linear_attn"
    spec = MambaSpec(shapes=((3,),), dtypes=(torch.float32,), block_size=384)
    req_ids = [f"r{i}" for i in range(4)]
    block_ids = [[b0, r] if c + n - 1 >= 384 else [r] for b0, r, c, n in
                 zip(block0, running, computed, lens)]
    runner = types.SimpleNamespace(
        compilation_config=types.SimpleNamespace(static_forward_context={name: layer}),
        cache_config=types.SimpleNamespace(mamba_cache_mode="align"),
        kv_cache_config=types.SimpleNamespace(kv_cache_groups=[
            types.SimpleNamespace(kv_cache_spec=spec, layer_names=[name])]),
        input_batch=types.SimpleNamespace(req_ids=req_ids),
        requests={r: types.SimpleNamespace(num_computed_tokens=c, block_ids=[ids])
                  for r, c, ids in zip(req_ids, computed, block_ids)},
        mamba_state_idx={r: len(ids) - 1 for r, ids in zip(req_ids, block_ids)})
    stores = boundary_stores(runner, 0, layer._dspine_step, torch.tensor(counts))
    assert stores.counts.tolist() == [6, 14, 0, 0]
    assert stores.slots.tolist() == [9, 10, 5, 6]

    sampled = torch.full((4, 16), -1, dtype=torch.long)
    for r, c in enumerate(counts):
        sampled[r, :c] = 7
    assert commit_step(runner, sampled) == 1
    for i, (c, n) in enumerate(zip(counts, lens)):
        st, win = before[running[i]]
        bx, ba, bb = blocks[i]
        _, want_st, want_win = gdn_forward_ref(st, win, bx[:c], ba[:c], bb[:c], w)
        got_st, got_win = layer.state(running[i])
        tol = 1e-5 if c < n else 2e-2  # whole blocks: vLLM's kernels' state (as above)
        assert torch.equal(got_win, want_win) and _rel(got_st, want_st) < tol, i
        got_st, got_win = layer.state(block0[i])
        if stores.counts[i] > 0:
            m = int(stores.counts[i])
            _, want_st, want_win = gdn_forward_ref(st, win, bx[:m], ba[:m], bb[:m], w)
            assert torch.equal(got_win, want_win) and _rel(got_st, want_st) < 1e-5, i
            _, off_st, _ = gdn_forward_ref(st, win, bx[:m + 1], ba[:m + 1], bb[:m + 1], w)
            assert _rel(got_st, off_st) > 1e-3, i  # one position more is far off
        elif block0[i] != running[i]:
            assert all(torch.equal(u, v) for u, v in zip((got_st, got_win), before[block0[i]]))

    # vLLM's bookkeeping moved on (the running block is not the last verified
    # position's): refused with a message, not a silent wrong store.
    gdn_core_cpu(original, layer, _gdn_metadata(lens, running), x, b, a, out)
    runner.mamba_state_idx["r0"] = 0
    with pytest.raises(RuntimeError, match="no-enable-prefix-caching"):
        commit_step(runner, sampled)
