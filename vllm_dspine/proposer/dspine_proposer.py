"""`DSpineProposer`: vLLM's DFlash proposer with DSpine's candidate retrieval and
serial tail in place of the per-row argmax, and the sparse q handed to verification.

What vLLM's DFlash plumbing already does and we keep: the target's auxiliary layer
outputs (`target_layer_ids`) fused by `fc` + `hidden_norm` into draft context K/V for
the newly committed positions only (rejected positions are excluded through
`num_rejected_tokens`), the block of anchor + mask rows as queries, causal attention.

What this class adds (small overrides of the base class's hooks):
- `set_inputs_first_pass`: remembers the anchors (the bonus/correction token ids).
- `_sample_draft_tokens`: candidates per row, 16 x 16 tables over the last bridge
  write, greedy walk or sampled chain per request; keeps the sparse q.
- `take_last_draft_probs`: hands the sparse q to vLLM's per-request draft-probs
  bookkeeping, packed as [num_reqs, K, 2k] (see `sparse_q.py`), which the model runner
  re-orders by request id and passes to the rejection sampler we install.
- `propose`: drafts only the rows that can be verified this step: the block's first
  n + 1 rows (anchor + n drafts) are the same as in a full block, because attention is
  causal inside the block and the bridge passes codes from row t - 1 to row t. n is the
  cap of vLLM's batch-size schedule (`num_speculative_tokens_per_batch_size`) and
  `dspine_verify_max`, and with `dspine_verify: dynamic` the row budget of `dynamic.py`,
  whose policy then shortens verification per request. Variable lengths go back to vLLM
  as a list of per-request draft lists, which vLLM's synchronous scheduler verifies as
  drafted (as it does for ngram); vLLM slices each request's cached sparse q to the
  verified prefix. When nothing would be verified, the block forward is skipped and
  only the draft context K/V of the newly committed positions is written (logged, and
  applied in one batch before the next block: `_store_context_only`).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from vllm.logger import init_logger
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.spec_decode.dflash import DFlashProposer

from vllm_dspine.hf_config import dspine_config_of
from vllm_dspine.step_profile import profile, timed
from vllm_dspine.kernels.cpu_gemm import FixedWeightMatmul
from vllm_dspine.kernels.retrieval import retrieve_candidates
from vllm_dspine.kernels.retrieval_ref import FP8Head
from vllm_dspine.kernels.retrieval import fp8_matmul_available
from vllm_dspine.kernels.tail import (SAMPLING_EPS, TailTables, continuous_score_tables,
                                      serial_tail, tail_score_tables)
from vllm_dspine.proposer.dynamic import (FIXED, GREEDY, SAMPLED, DynamicVerifier,
                                          FixedCost, draft_confidence)
from vllm_dspine.proposer.sparse_q import pack_sparse_q

logger = init_logger("vllm.dspine.proposer")  # under "vllm": printed in engine processes

# Logged context K/V writes are applied once they hold this many tokens (or before the
# next block): a few hundred rows make the projections' weight reads negligible, and
# the log stays ~3 MB at SmolLM2's 5 x 576 features.
CONTEXT_LOG_TOKENS = 256
# An fp32 head (vLLM on CPU) with at most this many retrieval rows is scored in fp32
# whole; above it a bf16 copy scores coarsely and the best 128 are rescored in fp32.
# Measured (`python bench/bench_tail.py --dtype fp32 --hidden 576 --code 64 --message 32
# --vocab V --reqs R --no-docs`, one thread): at 8 x 15 rows, V 6,227: 10.7 vs 37 ms;
# V 16,384: 35 vs 45 ms; V 49,152: 90 vs 62 ms (the rescore's [rows, 128, H] gather is
# what the copy costs; it pays only over the large product it saves).
EXACT_FP32_MAX_VOCAB = 24_576


def min_p_of_batch(sampling_metadata: SamplingMetadata, num_reqs: int
                   ) -> torch.Tensor | None:
    """Per-request min_p [num_reqs] from vLLM's MinPLogitsProcessor, None if unused."""
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor

    for proc in sampling_metadata.logitsprocs.argmax_invariant:
        if isinstance(proc, MinPLogitsProcessor):
            min_p = proc.min_p_cpu_tensor[:num_reqs].float()
            return min_p if bool((min_p > 0).any()) else None
    return None


class DSpineProposer(DFlashProposer):
    def __init__(self, vllm_config, device: torch.device, runner=None):
        super().__init__(vllm_config, device, runner)
        # The base class does not keep the runner; we need it once, at load, to
        # install the sparse-q rejection sampler.
        self._runner = runner
        hf_config = self.draft_model_config.hf_config
        self.dspine = dspine_config_of(hf_config)
        self.options: dict = dict(getattr(hf_config, "dspine_options", None) or {})
        self.retrieval_mode: str = self.options.get("dspine_retrieval", "auto")
        # False: the no-tail ablation (per-row candidates scored by the continuous logits).
        self.use_tail: bool = self.options.get("dspine_tail", True)
        self._anchor_ids: torch.Tensor | None = None  # [num_reqs]
        self._last_sparse_q: torch.Tensor | None = None  # [num_reqs, K, 2k]
        self._fp8_head: FP8Head | None = None
        self._coarse_head: torch.Tensor | None = None  # [V, H] bf16 copy of an fp32 head
        self._retrieval_ids: torch.Tensor | None = None  # [V'] the drafter's retrieval_vocab
        self._retrieval_head: torch.Tensor | None = None  # [V' or V, H]
        self._retrieval_matmul: FixedWeightMatmul | None = None
        self._tail_tables: TailTables | None = None
        self._debug_dump_dir = os.environ.get("VLLM_DSPINE_DEBUG_DUMP") or None
        # Verification length (docs/dynamic-verification.md).
        K = self.dspine.num_proposals
        self.verify_max: int = int(self.options.get("dspine_verify_max", K))
        dynamic = self.options.get("dspine_verify", "dynamic") == "dynamic"
        if (dynamic or self.verify_max < K) and vllm_config.scheduler_config.async_scheduling:
            raise ValueError(
                "DSpine verifies fewer than all drafts here (dspine_verify 'dynamic' or "
                "dspine_verify_max < 15), which vLLM's asynchronous scheduler cannot carry "
                "(it schedules a fixed number of draft slots before the drafter runs); "
                "run with --no-async-scheduling, or set dspine_verify 'fixed'")
        self._verifier: DynamicVerifier | None = None
        if dynamic and runner is not None:
            cost = self.options.get("dspine_verify_cost")
            self._verifier = DynamicVerifier(
                K, FixedCost.from_option(cost) if cost else None,
                max_batch_tokens=vllm_config.scheduler_config.max_num_batched_tokens)
        self._last_confidence = None  # [num_reqs, K] numpy, for the policy
        # [num_reqs] bool: requests whose drafts this step may verify (None: all).
        self._own_stream: np.ndarray | None = None
        # Context K/V writes of steps without a block, not yet applied (raw target
        # features [n, L_aux * H], positions [n], slots [n]): `_store_context_only`.
        self._context_log: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._context_log_tokens = 0
        # Only where KV blocks are freed at request boundaries alone (which
        # `before_step` sees): a sliding-window drafter frees blocks mid-request, and a
        # hybrid target's state pages share memory with other groups' blocks.
        self._log_context = (self.dspine.sliding_window is None
                             and not vllm_config.model_config.is_hybrid)

    # ---------------------------------------------------------------- loading
    def load_model(self, target_model) -> None:
        super().load_model(target_model)
        from vllm_dspine.proposer.validation import check_loaded_pair

        head = check_loaded_pair(self.dspine, target_model, self.model)
        self._head_weight = head  # [V, H], the target's own (shared, never copied)
        # What retrieval scores: the whole head, or the rows of the drafter's
        # `retrieval_vocab` (a copy, [V', H]; its candidates are mapped back to ids).
        vocab = self.dspine.retrieval_vocab
        self._retrieval_ids = (None if vocab is None else
                               torch.tensor(vocab, dtype=torch.long, device=head.device))
        retrieval_head = head if vocab is None else head[self._retrieval_ids].contiguous()
        self._retrieval_head = retrieval_head  # [V' or V, H]
        if self.retrieval_mode == "fp8" and not fp8_matmul_available(head.device):
            raise ValueError(
                "speculative_config['dspine_retrieval'] = 'fp8' needs FP8 matmul (CUDA, "
                "compute capability >= 8.9); use 'auto' or 'bf16' on this device")
        if self.retrieval_mode != "bf16" and fp8_matmul_available(head.device):
            self._fp8_head = FP8Head.from_head(retrieval_head)
        elif (head.dtype == torch.float32 and self.retrieval_mode != "fp8"
              and retrieval_head.shape[0] > EXACT_FP32_MAX_VOCAB):
            # An fp32 model (CPU): coarse scores from a bf16 copy of the head, the best
            # coarse_topk rescored with the fp32 head (kernels/retrieval.py). Smaller
            # heads are scored in fp32 whole: exact, and faster (EXACT_FP32_MAX_VOCAB).
            self._coarse_head = retrieval_head.to(torch.bfloat16).contiguous()
        if self._fp8_head is None and self._coarse_head is None:
            # The whole head is scored in its own dtype: vLLM's oneDNN matmul on CPU
            # (kernels/cpu_gemm.py), torch's elsewhere.
            self._retrieval_matmul = FixedWeightMatmul(retrieval_head)
        bridge = self.model.model.bridge.weights()
        self._tail_tables = TailTables.build(bridge, head, self.model.model.norm.weight)
        if self._runner is not None:
            from vllm_dspine.proposer.sparse_q import DSpineRejectionSampler

            self._runner.rejection_sampler = DSpineRejectionSampler(
                self._runner.sampler, self.speculative_config, self.device,
                runner=self._runner)
        logger.info("DSpine drafter loaded: block %d, %d candidates per row out of %d "
                    "ids, retrieval %s", self.dspine.block_size, self.dspine.head_topk,
                    retrieval_head.shape[0],
                    "fp8+rescore" if self._fp8_head is not None else
                    "bf16 copy of the fp32 head+rescore" if self._coarse_head is not None
                    else f"{str(head.dtype).replace('torch.', '')} full vocab")

    # ------------------------------------------------------------------ hooks
    def set_inputs_first_pass(self, target_token_ids, next_token_ids, target_positions,
                              target_hidden_states, token_indices_to_sample, cad,
                              num_rejected_tokens_gpu):
        self._anchor_ids = next_token_ids[: cad.batch_size()]
        # Rows per request of this step's block (the model finds its anchors with it).
        self.model.model.block_rows = 1 + self.num_speculative_tokens
        return super().set_inputs_first_pass(
            target_token_ids, next_token_ids, target_positions, target_hidden_states,
            token_indices_to_sample, cad, num_rejected_tokens_gpu)

    def _sample_draft_tokens(
        self,
        hidden_states: torch.Tensor,  # [num_reqs * K, H]  final-normed proposal rows
        sampling_metadata: SamplingMetadata,
    ) -> tuple[torch.Tensor, None]:
        with timed("retrieval_tail"):
            return self._retrieve_and_walk(hidden_states, sampling_metadata)

    def _retrieve_and_walk(
        self,
        hidden_states: torch.Tensor,  # [num_reqs * K, H]  final-normed proposal rows
        sampling_metadata: SamplingMetadata,
    ) -> tuple[torch.Tensor, None]:
        """Candidates, the tail's tables and walk, the sparse q (and the policy's
        confidences) for this step's block."""
        cfg = self.dspine
        # This step's block: anchor + K drafts per request (K <= the config's 15).
        K, k = self.num_speculative_tokens, cfg.head_topk
        B = K + 1
        num_reqs = hidden_states.shape[0] // K
        lw = self.model.model.last_write_inputs
        assert lw is not None and self._anchor_ids is not None
        H = lw.pre_write_state.shape[-1]
        rows = num_reqs * B
        x_last = lw.pre_write_state[:rows].view(num_reqs, B, H)
        codes = lw.codes[:rows].view(num_reqs, B, -1)
        rms = lw.rms[:rows].view(num_reqs, B)

        cand_ids = retrieve_candidates(
            hidden_states, self._retrieval_head, k, cfg.coarse_topk, self._fp8_head,
            mode="auto" if self._fp8_head is not None else "bf16",
            coarse_head=self._coarse_head,
            head_matmul=self._retrieval_matmul).view(num_reqs, K, k)
        if self._retrieval_ids is not None:
            cand_ids = self._retrieval_ids[cand_ids]  # rows of the sub-head -> token ids

        device = hidden_states.device
        if sampling_metadata.all_greedy or sampling_metadata.temperature is None:
            temperature = torch.zeros(num_reqs, dtype=torch.float32, device=device)
            top_k = top_p = min_p = None
            generators = None
        else:
            temperature = sampling_metadata.temperature[:num_reqs].float()
            top_k = (None if sampling_metadata.top_k is None
                     else sampling_metadata.top_k[:num_reqs])
            top_p = (None if sampling_metadata.top_p is None
                     else sampling_metadata.top_p[:num_reqs].float())
            min_p = min_p_of_batch(sampling_metadata, num_reqs)
            min_p = None if min_p is None else min_p.to(device)
            # A request still in a chunked prefill gets drafts vLLM will discard: draw
            # them from the global RNG so its own seeded stream does not depend on
            # how its prompt was chunked.
            discarded = (self._runner.discard_request_mask.np[:num_reqs]
                         if self._runner is not None else [False] * num_reqs)
            # A seeded request whose drafts this step will not verify (its own length
            # rule gave 0) draws from the global RNG too: whether the block runs at all
            # depends on the rest of the batch, its seeded stream must not.
            own = self._own_stream
            generators = [None if discarded[i] or (own is not None and not own[i])
                          else sampling_metadata.generators.get(i)
                          for i in range(num_reqs)]

        if self.use_tail:
            # `refine_last_write`, with the tables kept for the policy's confidence.
            any_sampled = bool((temperature >= SAMPLING_EPS).any())
            S = tail_score_tables(
                x_last, codes, rms, cand_ids, self._anchor_ids[:num_reqs].long(),
                self.model.model.bridge.weights(), self.model.model.norm.weight,
                self.model.model.norm.variance_epsilon, self._head_weight,
                self._tail_tables, torch.float64 if any_sampled else torch.float32)
        else:
            dtype = torch.float64 if bool((temperature > 0).any()) else torch.float32
            S = continuous_score_tables(hidden_states.view(num_reqs, K, -1), cand_ids,
                                        self._head_weight, dtype)
        # Seeded requests draw the full block's uniforms whatever rows run this step.
        proposal = serial_tail(S, cand_ids, temperature, top_k, top_p, min_p, generators,
                               draws_per_request=cfg.num_proposals)
        self._last_sparse_q = pack_sparse_q(proposal.cand_ids, proposal.cand_probs)
        if self._verifier is not None:
            self._last_confidence = draft_confidence(
                S, proposal.cand_ids, proposal.cand_probs, proposal.draft_token_ids,
                temperature < SAMPLING_EPS).cpu().numpy()
        if self._debug_dump_dir:
            self._debug_dump(num_reqs, hidden_states, cand_ids, proposal)
        return proposal.draft_token_ids.reshape(-1), None

    def _debug_dump(self, num_reqs, hidden_states, cand_ids, proposal) -> None:
        """Writes one step's drafter inputs/outputs (tests compare them with the
        reference drafter). Only with VLLM_DSPINE_DEBUG_DUMP=dir; never in serving."""
        B = self.num_speculative_tokens + 1  # this step's rows per request
        req_ids = list(self._runner.input_batch.req_ids[:num_reqs]) if self._runner else []
        self._dump_step = getattr(self, "_dump_step", 0) + 1
        torch.save({
            "req_ids": req_ids,
            "anchor_ids": self._anchor_ids[:num_reqs].cpu(),
            "anchor_positions": self.positions[: num_reqs * B: B].cpu(),
            "final_hidden": hidden_states.float().cpu(),  # [num_reqs * K, H]
            "cand_ids": cand_ids.cpu(),
            "draft_token_ids": proposal.draft_token_ids.cpu(),
            "cand_probs": proposal.cand_probs.cpu(),
        }, os.path.join(self._debug_dump_dir, f"step{os.getpid()}_{self._dump_step:05d}.pt"))

    def take_last_draft_probs(self) -> torch.Tensor | None:
        q, self._last_sparse_q = self._last_sparse_q, None
        return q

    # ------------------------------------------------------ verification length
    def propose(self, num_speculative_tokens, target_token_ids, target_positions,
                target_hidden_states, next_token_ids, token_indices_to_sample,
                common_attn_metadata, sampling_metadata, mm_embed_inputs=None,
                num_rejected_tokens_gpu=None, slot_mappings=None):
        """vLLM's `propose`, asked for `num_speculative_tokens` drafts (15, or what its
        batch-size schedule says for this batch size). Only the block's rows that can be
        verified are drafted; returns [num_reqs, n] drafts (one length for all) or, with
        the dynamic policy, one list of drafts per request."""
        K = self.dspine.num_proposals
        step_cap = max(0, min(int(num_speculative_tokens), self.verify_max, K))
        num_reqs = common_attn_metadata.batch_size()
        inputs = dict(
            target_token_ids=target_token_ids, target_positions=target_positions,
            target_hidden_states=target_hidden_states, next_token_ids=next_token_ids,
            token_indices_to_sample=token_indices_to_sample,
            common_attn_metadata=common_attn_metadata, sampling_metadata=sampling_metadata,
            mm_embed_inputs=mm_embed_inputs, num_rejected_tokens_gpu=num_rejected_tokens_gpu,
            slot_mappings=slot_mappings)
        v = self._verifier
        if v is None:
            if step_cap == 0:
                self._store_context_only(inputs)
                return torch.empty(num_reqs, 0, dtype=torch.int64, device=self.device)
            return self._draft_rows(step_cap, inputs)

        runner = self._runner
        req_ids = list(runner.input_batch.req_ids[:num_reqs])
        states = [runner.requests[r] for r in req_ids]
        verified = [int(s.prev_num_draft_len) for s in states]
        rejected = (None if num_rejected_tokens_gpu is None
                    else num_rejected_tokens_gpu[:num_reqs].tolist())
        v.begin(req_ids, verified, rejected, int(target_token_ids.shape[0]))
        kinds, caps = self._kinds_and_caps(states, step_cap, verified, rejected)
        plan = v.plan(kinds, caps)
        if not plan.draft:
            self._store_context_only(inputs)
            v.context_only(plan.caps)
            v.end(req_ids, drafted=False)
            return [[] for _ in range(num_reqs)]
        self._own_stream = plan.caps > 0
        try:
            drafts = self._draft_rows(max(1, min(plan.rows, step_cap)), inputs).tolist()
        finally:
            self._own_stream = None
        lengths = v.choose(req_ids, kinds, caps, self._last_confidence, plan)
        v.end(req_ids, drafted=True)
        return [row[:int(n)] for row, n in zip(drafts, lengths)]

    def _draft_rows(self, n: int, inputs: dict) -> torch.Tensor:
        """vLLM's DFlash `propose` for a block of anchor + n drafts per request (its
        `num_speculative_tokens` is the block's row count minus one) -> [num_reqs, n]."""
        prof = profile()
        t0 = prof.now() if prof is not None else 0.0
        r0 = prof.seconds["retrieval_tail"] if prof is not None else 0.0
        try:
            self._flush_context_log()  # the block reads every earlier context write
            return super().propose(n, **inputs)
        finally:
            # vLLM's warm-up and dummy runs read it: keep the configured block.
            self.num_speculative_tokens = self.dspine.num_proposals
            if prof is not None:  # the block forward: all but retrieval + tail
                prof.add("draft_forward",
                         prof.now() - t0 - (prof.seconds["retrieval_tail"] - r0))

    def _kinds_and_caps(self, states, step_cap: int, verified: list[int],
                        rejected: list[int] | None) -> tuple[np.ndarray, np.ndarray]:
        """Per request: GREEDY / SAMPLED / FIXED (sampled with its own seed) and the most
        drafts it may verify next step (0 while its prompt is still being prefilled;
        and no more than its remaining max_tokens can use)."""
        from vllm.sampling_params import SamplingType

        n = len(states)
        discarded = self._runner.discard_request_mask.np[:n]
        kinds = np.full(n, SAMPLED, dtype=np.int64)
        caps = np.zeros(n, dtype=np.int64)
        for i, st in enumerate(states):
            if discarded[i]:
                continue
            sp = st.sampling_params
            if sp is None or sp.sampling_type == SamplingType.GREEDY:
                kinds[i] = GREEDY
            elif st.generator is not None:
                kinds[i] = FIXED
            cap = step_cap
            if sp is not None and sp.max_tokens is not None:
                committed = 1 if rejected is None else verified[i] - int(rejected[i]) + 1
                cap = min(cap, sp.max_tokens - len(st.output_token_ids) - committed - 1)
            caps[i] = max(cap, 0)
        return kinds, caps

    def _store_context_only(self, inputs: dict) -> None:
        """The first part of vLLM's DFlash `propose` without the block: the newly
        committed positions' features -> draft context K/V in the draft KV cache (the
        positions vLLM rejected excluded, as always). Later blocks attend to exactly
        these; a block's own rows are scratch that the next step's context overwrites.

        Where blocks are freed only when requests finish or are preempted, the write is
        logged, not run: `_flush_context_log` applies the log in order before the next
        block reads the cache (`_draft_rows`), before a step whose scheduler freed
        blocks (`before_step`: its forward may write into them), or once the log holds
        CONTEXT_LOG_TOKENS. Applied in order, a slot written twice ends as the eager
        writes would leave it. Batched, the fc and K/V projections read their weights
        once for many steps' tokens: the context-only path runs one or a few tokens a
        step, and at that size it costs the projections' weight reads."""
        with timed("draft_forward"):
            self.num_speculative_tokens = self.dspine.num_proposals  # the kernel's layout
            # vLLM's own layout kernel: positions and slots of the newly committed tokens
            # (rejected ones get the padding slot, which the cache update skips).
            self.set_inputs_first_pass(
                inputs["target_token_ids"], inputs["next_token_ids"],
                inputs["target_positions"], inputs["target_hidden_states"],
                inputs["token_indices_to_sample"], inputs["common_attn_metadata"],
                inputs["num_rejected_tokens_gpu"])
            n = self._dflash_num_context
            hidden = inputs["target_hidden_states"][:n]  # [n, L_aux * H] raw features
            positions = self._context_positions_buffer[:n]  # [n]
            slots = self._context_slot_mapping_buffer[:n]  # [n]
            if not self._log_context:  # eager: written now, nothing kept
                self._write_context(hidden, positions, slots)
            else:  # kept past this step: copies (the buffers are reused)
                self._context_log.append((hidden.clone(), positions.clone(), slots.clone()))
                self._context_log_tokens += n
                if self._context_log_tokens >= CONTEXT_LOG_TOKENS:
                    self._flush_context_log()
        self._last_sparse_q = None
        self._last_confidence = None

    def before_step(self, scheduler_output) -> None:
        """Called before each engine step runs (patch 11): blocks freed since the last
        step may be written by this step's forward, so the logged writes go first."""
        if self._context_log and (scheduler_output.finished_req_ids
                                  or scheduler_output.preempted_req_ids):
            self._flush_context_log()

    def _flush_context_log(self) -> None:
        """Writes the logged context K/V (oldest first, as one batch)."""
        if not self._context_log:
            return
        log, self._context_log, self._context_log_tokens = self._context_log, [], 0
        self._write_context(*(torch.cat(parts) for parts in zip(*log)))

    def _write_context(self, hidden: torch.Tensor, positions: torch.Tensor,
                       slots: torch.Tensor) -> None:
        """Context K/V of raw target features [n, L_aux * H] at `positions` into the
        draft KV cache `slots` [n]."""
        self.model.precompute_and_store_context_kv(
            self.model.combine_hidden_states(hidden), positions, slots)
