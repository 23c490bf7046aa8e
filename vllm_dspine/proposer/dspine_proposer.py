"""`DSpineProposer`: vLLM's DFlash proposer with DSpine's candidate retrieval and
serial tail in place of the per-row argmax, and the sparse q handed to verification.

What vLLM's DFlash plumbing already does and we keep: the target's auxiliary layer
outputs (`target_layer_ids`) fused by `fc` + `hidden_norm` into draft context K/V for
the newly committed positions only (rejected positions are excluded through
`num_rejected_tokens`), the block of anchor + mask rows as queries, causal attention.

One step, stage by stage, each handing a value to the next:
  block forward (`model/vllm_model.py`, called by vLLM's `propose`)
    -> `LastWriteInputs` through the model's `LastWriteHandover` (vLLM passes on only
       hidden states; the handover's docstring says why) and the final hidden states
  -> retrieval (`RetrievalHead.candidates`, retrieval_head.py) -> cand_ids [R, K, k]
  -> tail (`tail_score_tables`, `serial_tail`, kernels/tail.py) -> `SparseProposal`
  -> packed sparse q, kept for vLLM's `take_last_draft_probs`; drafts back to vLLM;
     with the dynamic policy the block's confidences back to `propose`.

What this class adds (small overrides of the base class's hooks):
- `set_inputs_first_pass`: tells the model this step's rows per request.
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
  applied in one batch before the next block: `_store_context_only`, context_log.py).
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
from vllm_dspine.kernels.tail import (SAMPLING_EPS, LastWriteInputs, TailTables, TailWeights,
                                      continuous_score_tables, serial_tail,
                                      tail_score_tables)
from vllm_dspine.model.lookup_corpus import resolve_lookup_corpus
from vllm_dspine.proposer.calibration import draft_confidence
from vllm_dspine.proposer.context_log import ContextLog
from vllm_dspine.proposer.corpus_lookup import CorpusIndex
from vllm_dspine.proposer.dynamic import AT_CAP, GREEDY, LOOKUP, SAMPLED, DynamicVerifier
from vllm_dspine.proposer.lookup import LookupBatch, PromptLookup, lookup_sparse_q
from vllm_dspine.proposer.retrieval_head import RetrievalHead
from vllm_dspine.proposer.sparse_q import pack_sparse_q
from vllm_dspine.proposer.step_cost import InjectedStepCost
from vllm_dspine.proposer.validation import DEFAULT_LOOKUP, DEFAULT_OBJECTIVE

logger = init_logger("vllm.dspine.proposer")  # under "vllm": printed in engine processes


def min_p_of_batch(sampling_metadata: SamplingMetadata, num_reqs: int
                   ) -> torch.Tensor | None:
    """Per-request min_p [num_reqs] from vLLM's MinPLogitsProcessor, None if unused."""
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor

    for proc in sampling_metadata.logitsprocs.argmax_invariant:
        if isinstance(proc, MinPLogitsProcessor):
            min_p = proc.min_p_cpu_tensor[:num_reqs].float()
            return min_p if bool((min_p > 0).any()) else None
    return None


def _count_sources(lengths: np.ndarray, source: np.ndarray,
                   lookup: LookupBatch | None = None) -> None:
    """Request-steps and drafts verified per source, into the step profile (when on);
    `corpus_*` counts the lookup's that came from the corpus lookup (a part of
    `lookup_*`)."""
    prof = profile()
    if prof is None:
        return
    lengths = np.asarray(lengths)
    corpus = (lookup.from_corpus if lookup is not None and lookup.from_corpus is not None
              else np.zeros(len(lengths), dtype=bool))
    for name, mask in (("lookup", source == LOOKUP), ("drafter", source != LOOKUP),
                       ("corpus", (source == LOOKUP) & corpus)):
        sel = mask & (lengths > 0)
        prof.count(f"{name}_request_steps", int(sel.sum()))
        prof.count(f"{name}_drafts", int(lengths[sel].sum()))


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
        # Built at load (`load_model`).
        self._retrieval: RetrievalHead | None = None
        self._tail_weights: TailWeights | None = None
        self._tail_tables: TailTables | None = None
        self._last_sparse_q: torch.Tensor | None = None  # [num_reqs, K, 2k]
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
                K, InjectedStepCost.from_option(cost) if cost else None,
                max_batch_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
                objective=self.options.get("dspine_verify_objective", DEFAULT_OBJECTIVE))
        # Prompt lookup as a second source of drafts (docs/lookup.md): with the
        # dynamic policy only, which chooses between it and the drafter.
        self._lookup: PromptLookup | None = None
        if self._verifier is not None and self.options.get("dspine_lookup", DEFAULT_LOOKUP):
            self._lookup = PromptLookup(self.options.get("dspine_lookup_min", 2),
                                        self.options.get("dspine_lookup_max", 4), K,
                                        corpus=self._load_lookup_corpus())
        # The drafted block's confidences [num_reqs, K] (numpy) for the policy, from
        # `_sample_draft_tokens` to `_draft_rows`, across vLLM's `propose` (which
        # returns only the drafts); `_draft_rows` takes it.
        self._block_confidence: np.ndarray | None = None
        # [num_reqs] bool: requests whose drafts this step may verify (None: all); set
        # by `propose` around vLLM's `propose` for `_sample_draft_tokens`.
        self._own_stream: np.ndarray | None = None
        # Context K/V writes of steps without a block (`_store_context_only`). Deferred
        # only where KV blocks are freed at request boundaries alone (which
        # `before_step` sees): a sliding-window drafter frees blocks mid-request, and a
        # hybrid target's state pages share memory with other groups' blocks.
        self._context_log = ContextLog(
            self._write_context,
            deferred=(self.dspine.sliding_window is None
                      and not vllm_config.model_config.is_hybrid))

    # ---------------------------------------------------------------- loading
    def _load_lookup_corpus(self) -> CorpusIndex | None:
        """The corpus lookup's index (docs/lookup.md "The corpus lookup"), off unless
        asked for: `dspine_lookup_corpus: true` reads the drafter folder's
        `lookup_corpus.npz`, a path names another file. (Off by default: measured on the
        SmolLM2 pair it did not pay at every setting, docs/lookup.md.)"""
        path = resolve_lookup_corpus(self.options.get("dspine_lookup_corpus"),
                                     self.draft_model_config.model)
        if path is None:
            return None
        index = CorpusIndex.load(path)
        logger.info("DSpine corpus lookup: %d tokens from %s", index.num_tokens, path)
        return index

    def load_model(self, target_model) -> None:
        super().load_model(target_model)
        from vllm_dspine.proposer.validation import check_loaded_pair

        head = check_loaded_pair(self.dspine, target_model, self.model)  # [V, H]
        self._retrieval = RetrievalHead.build(head, self.dspine.retrieval_vocab,
                                              self.retrieval_mode)
        drafter = self.model.model
        # The target's own head (shared, never copied), the drafter's bridge and norm.
        self._tail_weights = TailWeights(
            bridge=drafter.bridge.weights(), norm_weight=drafter.norm.weight,
            norm_eps=drafter.norm.variance_epsilon, head_weight=head)
        self._tail_tables = TailTables.build(self._tail_weights.bridge, head,
                                             drafter.norm.weight)
        if self._runner is not None:
            from vllm_dspine.proposer.sparse_q import DSpineRejectionSampler

            self._runner.rejection_sampler = DSpineRejectionSampler(
                self._runner.sampler, self.speculative_config, self.device,
                runner=self._runner)
        logger.info("DSpine drafter loaded: block %d, %d candidates per row out of %d "
                    "ids, retrieval %s, layer products %s", self.dspine.block_size,
                    self.dspine.head_topk, self._retrieval.num_rows,
                    self._retrieval.describe(),
                    getattr(self.model, "layer_gemm_dtype", drafter.norm.weight.dtype))

    # ------------------------------------------------------------------ hooks
    def set_inputs_first_pass(self, target_token_ids, next_token_ids, target_positions,
                              target_hidden_states, token_indices_to_sample, cad,
                              num_rejected_tokens_gpu):
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
            # What the block forward vLLM just ran handed over (vllm_model.py).
            last_write = self.model.model.last_write.take()
            return self._retrieve_and_walk(hidden_states, last_write, sampling_metadata)

    def _retrieve_and_walk(
        self,
        hidden_states: torch.Tensor,  # [num_reqs * K, H]  final-normed proposal rows
        last_write: LastWriteInputs,  # [R', B, ...], R' >= num_reqs (a padded batch)
        sampling_metadata: SamplingMetadata,
    ) -> tuple[torch.Tensor, None]:
        """Candidates, the tail's tables and walk, the sparse q (and the policy's
        confidences) for this step's block."""
        cfg = self.dspine
        # This step's block: anchor + K drafts per request (K <= the config's 15).
        K, k = self.num_speculative_tokens, cfg.head_topk
        num_reqs = hidden_states.shape[0] // K
        inputs = last_write.first_requests(num_reqs)
        assert inputs.pre_write_state.shape[:2] == (num_reqs, K + 1), (
            inputs.pre_write_state.shape, num_reqs, K)
        cand_ids = self._retrieval.candidates(hidden_states, k, cfg.coarse_topk
                                              ).view(num_reqs, K, k)
        temperature, top_k, top_p, min_p, generators = self._sampling_of_batch(
            sampling_metadata, num_reqs, hidden_states.device)

        if self.use_tail:
            # `refine_last_write`, with the tables kept for the policy's confidence.
            any_sampled = bool((temperature >= SAMPLING_EPS).any())
            S = tail_score_tables(inputs, cand_ids, self._tail_weights, self._tail_tables,
                                  torch.float64 if any_sampled else torch.float32)
        else:
            dtype = torch.float64 if bool((temperature > 0).any()) else torch.float32
            S = continuous_score_tables(hidden_states.view(num_reqs, K, -1), cand_ids,
                                        self._tail_weights.head_weight, dtype)
        # Seeded requests draw the full block's uniforms whatever rows run this step.
        proposal = serial_tail(S, cand_ids, temperature, top_k, top_p, min_p, generators,
                               draws_per_request=cfg.num_proposals)
        self._last_sparse_q = pack_sparse_q(proposal.cand_ids, proposal.cand_probs)
        if self._verifier is not None:
            self._block_confidence = draft_confidence(
                S, proposal.cand_ids, proposal.cand_probs, proposal.draft_token_ids,
                temperature < SAMPLING_EPS).cpu().numpy()
        if self._debug_dump_dir:
            self._debug_dump(num_reqs, hidden_states, inputs.anchor_ids, cand_ids, proposal)
        return proposal.draft_token_ids.reshape(-1), None

    def _sampling_of_batch(self, sampling_metadata: SamplingMetadata, num_reqs: int,
                           device: torch.device):
        """The tail's sampling settings per request: temperature [num_reqs] (0: greedy),
        top_k, top_p, min_p [num_reqs] or None, and one generator (or None: the global
        RNG) per request."""
        if sampling_metadata.all_greedy or sampling_metadata.temperature is None:
            temperature = torch.zeros(num_reqs, dtype=torch.float32, device=device)
            return temperature, None, None, None, None
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
        return temperature, top_k, top_p, min_p, generators

    def _debug_dump(self, num_reqs, hidden_states, anchor_ids, cand_ids, proposal) -> None:
        """Writes one step's drafter inputs/outputs (tests compare them with the
        reference drafter). Only with VLLM_DSPINE_DEBUG_DUMP=dir; never in serving."""
        B = self.num_speculative_tokens + 1  # this step's rows per request
        req_ids = list(self._runner.input_batch.req_ids[:num_reqs]) if self._runner else []
        self._dump_step = getattr(self, "_dump_step", 0) + 1
        torch.save({
            "req_ids": req_ids,
            "anchor_ids": anchor_ids.cpu(),
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
            return self._draft_rows(step_cap, inputs)[0]

        runner = self._runner
        req_ids = list(runner.input_batch.req_ids[:num_reqs])
        states = [runner.requests[r] for r in req_ids]
        verified = [int(s.prev_num_draft_len) for s in states]
        rejected = (None if num_rejected_tokens_gpu is None
                    else num_rejected_tokens_gpu[:num_reqs].tolist())
        v.begin(req_ids, verified, rejected, int(target_token_ids.shape[0]))
        kinds, caps = self._kinds_and_caps(states, step_cap, verified, rejected)
        # The lookup before the plan: a seeded request's source and length follow its own
        # context and history (`DynamicVerifier.plan`), from the first step on.
        lookup = None
        if self._lookup is not None:
            lookup = self._lookup_of_batch(num_reqs, caps, verified, rejected,
                                           next_token_ids)
        plan = v.plan(kinds, caps, None if lookup is None else lookup.lengths)
        if not plan.draft or v.lookup_replaces_drafter(plan, kinds, lookup):
            self._store_context_only(inputs)
            lengths = v.choose_lookup_only(req_ids, kinds, plan.caps, lookup, plan.lookup)
            v.end(req_ids, drafted=False)
            _count_sources(lengths, np.full(num_reqs, LOOKUP), lookup)
            if not lengths.any():
                return [[] for _ in range(num_reqs)]
            self._last_sparse_q = self._with_lookup_q(None, lookup, lengths > 0)
            return [row[:int(n)] for row, n in zip(lookup.drafts.tolist(), lengths)]
        # A seeded request's own stream serves only the drafts it verifies: not the
        # block's, when it takes the lookup.
        self._own_stream = plan.caps > 0
        if plan.lookup is not None:
            self._own_stream = self._own_stream & ~plan.lookup
        try:
            drafts, confidence = self._draft_rows(max(1, min(plan.rows, step_cap)), inputs)
        finally:
            self._own_stream = None
        lengths = v.choose(req_ids, kinds, caps, confidence, plan, lookup)
        v.end(req_ids, drafted=True)
        _count_sources(lengths, v.last_source, lookup)
        from_lookup = (v.last_source == LOOKUP) & (lengths > 0)
        if from_lookup.any():
            self._last_sparse_q = self._with_lookup_q(self._last_sparse_q, lookup, from_lookup)
        return [(lk[:int(n)] if use else row[:int(n)]) for row, lk, n, use in zip(
            drafts.tolist(), lookup.drafts.tolist() if lookup is not None
            else [None] * num_reqs, lengths, from_lookup)]

    # ---------------------------------------------------------------- lookup
    def _lookup_of_batch(self, num_reqs: int, caps: np.ndarray,
                         verified: list[int], rejected: list[int] | None,
                         next_token_ids: torch.Tensor) -> LookupBatch:
        """The lookup's proposal per request (docs/lookup.md) from its context after
        this step: vLLM's `token_ids_cpu` row holds the committed tokens
        (`num_tokens_no_spec`) and then the drafts this step verified; the accepted ones
        and the correction / bonus token (`next_token_ids`) extend the context. The
        drafter runs before vLLM's bookkeeping appends them, so the row is read here.
        The row's first `num_prompt_tokens` are the prompt (where a continuation is
        copied from is one of the lookup calibrator's features). Requests without a cap
        get none."""
        batch = self._runner.input_batch
        tokens, committed = batch.token_ids_cpu, batch.num_tokens_no_spec
        nxt = next_token_ids[:num_reqs].cpu().numpy()
        contexts: list[np.ndarray | None] = []
        for i in range(num_reqs):
            if caps[i] <= 0:
                contexts.append(None)
                continue
            accepted = 0 if rejected is None else max(int(verified[i]) - int(rejected[i]), 0)
            end = int(committed[i]) + accepted
            if end >= tokens.shape[1]:  # at the model's length: nothing to propose
                contexts.append(None)
                continue
            ctx = np.empty(end + 1, dtype=np.int32)
            ctx[:end] = tokens[i, :end]
            ctx[end] = nxt[i]
            contexts.append(ctx)
        return self._lookup.propose(contexts, caps, batch.num_prompt_tokens[:num_reqs])

    def _with_lookup_q(self, packed: torch.Tensor | None, lookup: LookupBatch,
                       rows: np.ndarray) -> torch.Tensor:
        """The packed sparse q [R, K, 2k] with the requests `rows` [R] bool holding
        the lookup's q (1 at each drafted token); the drafter's rows of a shorter block
        padded with q = 0 (never read: a drafter request verifies no more drafts than
        its block has)."""
        K, k = self.dspine.num_proposals, self.dspine.head_topk
        R = lookup.drafts.shape[0]
        out = torch.zeros((R, K, 2 * k), dtype=torch.float64, device=self.device)
        out[:, :, :k] = -1
        if packed is not None:
            out[:, :packed.shape[1]] = packed.to(out.device)
        sel = torch.from_numpy(np.nonzero(rows)[0]).to(self.device)
        ids, probs = lookup_sparse_q(
            torch.from_numpy(lookup.drafts).to(self.device)[sel], k)
        out[sel] = pack_sparse_q(ids, probs).to(out.dtype)
        return out

    def _draft_rows(self, n: int, inputs: dict) -> tuple[torch.Tensor, np.ndarray | None]:
        """vLLM's DFlash `propose` for a block of anchor + n drafts per request (its
        `num_speculative_tokens` is the block's row count minus one) -> drafts
        [num_reqs, n], and the drafts' confidences [num_reqs, n] for the dynamic policy
        (None without it)."""
        prof = profile()
        t0 = prof.now() if prof is not None else 0.0
        r0 = prof.seconds["retrieval_tail"] if prof is not None else 0.0
        try:
            self._context_log.flush()  # the block reads every earlier context write
            self._block_confidence = None
            drafts = super().propose(n, **inputs)
            confidence, self._block_confidence = self._block_confidence, None
            return drafts, confidence
        finally:
            # vLLM's warm-up and dummy runs read it: keep the configured block.
            self.num_speculative_tokens = self.dspine.num_proposals
            if prof is not None:  # the block forward: all but retrieval + tail
                prof.add("draft_forward",
                         prof.now() - t0 - (prof.seconds["retrieval_tail"] - r0))

    def _kinds_and_caps(self, states, step_cap: int, verified: list[int],
                        rejected: list[int] | None) -> tuple[np.ndarray, np.ndarray]:
        """Per request: GREEDY / SAMPLED / AT_CAP (sampled with its own seed: its cap
        becomes its own history's length, `SeededLengthRule`) and the most drafts it may
        verify next step (0 while its prompt is still being prefilled; and no more than
        its remaining max_tokens can use)."""
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
                kinds[i] = AT_CAP
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
        logged, not run (`ContextLog`, context_log.py): the log is applied in order
        before the next block reads the cache (`_draft_rows`), before a step whose
        scheduler freed blocks (`before_step`: its forward may write into them), or once
        it holds CONTEXT_LOG_TOKENS."""
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
            self._context_log.add(hidden, positions, slots)
        self._last_sparse_q = None

    def before_step(self, scheduler_output) -> None:
        """Called before each engine step runs (patch `context-log-before-step`): blocks
        freed since the last step may be written by this step's forward, so the logged
        writes go first."""
        if len(self._context_log) and (scheduler_output.finished_req_ids
                                       or scheduler_output.preempted_req_ids):
            self._context_log.flush()

    def _write_context(self, hidden: torch.Tensor, positions: torch.Tensor,
                       slots: torch.Tensor) -> None:
        """Context K/V of raw target features [n, L_aux * H] at `positions` into the
        draft KV cache `slots` [n]."""
        self.model.precompute_and_store_context_kv(
            self.model.combine_hidden_states(hidden), positions, slots)
