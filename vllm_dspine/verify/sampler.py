"""vLLM's rejection sampler with a sparse draft distribution (docs/design.md section 1.6).

`SparseRejectionSampler` subclasses vLLM 0.32.0's `RejectionSampler` because that
class is the interface the model runner calls; only `forward` is replaced. It does
what vLLM's `forward` does (bonus tokens through vLLM's `Sampler`, vLLM's
`apply_logits_processors` for penalties, allowed ids, bad words and min-tokens,
logprobs through the inherited `_get_logprobs_tensors`), with three differences:

  * the draft distribution is the sparse q (`draft_cand_ids`, `draft_cand_probs`);
  * per-request sampling values are expanded to draft rows with
    `torch.repeat_interleave`, never with vLLM's `expand_batch_to_tokens` (its CPU
    override returns uninitialised memory for floats, docs/measured.md);
  * the draft rows get the processing vLLM's own sampler gives a normal step and
    vLLM's rejection sampler leaves out: logit bias (before penalties, as in
    `Sampler.apply_logits_processors`) and min-p (after temperature, before
    top-k/top-p, as in `Sampler.sample`);
  * top-k/top-p of the draft rows give vLLM's result bit for bit without sorting the
    vocabulary with indices on CPU (`top_k_top_p.py`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.rejection_sampler import (
    GREEDY_TEMPERATURE,
    MAX_SPEC_LEN,
    PLACEHOLDER_TOKEN_ID,
    RejectionSampler,
)
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

from vllm_dspine.verify.sparse_rejection import drop_invalid_q, sparse_rejection_sample
from vllm_dspine.verify.top_k_top_p import apply_top_k_top_p_values_sorted
from vllm_dspine.verify.sparse_rejection_ref import (
    generate_inv_exp,
    generate_recovered_uniforms,
    generate_uniform_probs,
    sampled_drafts_accepted,
    sparse_recovered_tokens_inverse_cdf,
)


def expand_to_draft_rows(
    values: torch.Tensor,  # [num_reqs] or [num_reqs, 1]
    num_draft_tokens: list[int],  # [num_reqs]
) -> torch.Tensor:
    """Per-request values repeated over each request's draft rows: [num_tokens].

    E.g. values [a, b, c], num_draft_tokens [2, 0, 3] -> [a, a, c, c, c].
    """
    repeats = torch.tensor(num_draft_tokens, dtype=torch.int64, device=values.device)
    return torch.repeat_interleave(values.reshape(-1), repeats)


def _check_logits_processors(sampling_metadata: SamplingMetadata) -> None:
    """Custom processors cannot be applied to draft rows (their state is per
    request row); vLLM refuses them with speculative decoding, so this only guards
    against that changing underneath us."""
    known = (LogitBiasLogitsProcessor, MinPLogitsProcessor, MinTokensLogitsProcessor)
    for processor in sampling_metadata.logitsprocs.all:
        if not isinstance(processor, known):
            raise ValueError(
                f"logits processor {type(processor).__name__} cannot be applied to "
                "draft positions by the dspine verifier; remove it or run without "
                "speculative decoding."
            )


def apply_logit_bias_to_drafts(
    logits: torch.Tensor,  # [num_tokens, V], updated in place
    sampling_metadata: SamplingMetadata,
    num_draft_tokens: list[int],
) -> torch.Tensor:
    """Each request's `logit_bias` added to all of its draft rows."""
    for processor in sampling_metadata.logitsprocs.non_argmax_invariant:
        if not isinstance(processor, LogitBiasLogitsProcessor) or not processor.biases:
            continue
        starts = [0]
        for n in num_draft_tokens:
            starts.append(starts[-1] + n)
        rows: list[int] = []
        cols: list[int] = []
        biases: list[float] = []
        for req_idx, bias in processor.biases.items():
            if req_idx >= len(num_draft_tokens):
                continue
            for row in range(starts[req_idx], starts[req_idx + 1]):
                rows.extend([row] * len(bias))
                cols.extend(bias.keys())
                biases.extend(bias.values())
        if rows:
            device = logits.device
            index = (
                torch.tensor(rows, dtype=torch.int64, device=device),
                torch.tensor(cols, dtype=torch.int64, device=device),
            )
            logits.index_put_(
                index, torch.tensor(biases, dtype=logits.dtype, device=device),
                accumulate=True,
            )
    return logits


def _min_p_of(sampling_metadata: SamplingMetadata) -> torch.Tensor | None:
    """The batch's min-p values [num_reqs] if any request sets one, else None."""
    for processor in sampling_metadata.logitsprocs.argmax_invariant:
        if isinstance(processor, MinPLogitsProcessor) and processor.min_p_count:
            return processor.min_p.reshape(-1)
    return None


def apply_draft_sampling_constraints(
    logits: torch.Tensor,  # [num_tokens, V] float32, updated in place
    num_draft_tokens: list[int],  # [num_reqs]
    sampling_metadata: SamplingMetadata,
) -> torch.Tensor:
    """Temperature, min-p, top-k and top-p on the draft rows, in the order and with
    the formulas of vLLM's `Sampler.sample` (greedy requests get temperature 1 and
    are read through their argmax only)."""
    if sampling_metadata.all_greedy or logits.shape[0] == 0:
        # No draft rows: vLLM 0.32.0 builds spec-decode metadata for every step once
        # speculation is configured, drafts or not, and its top-k-only CPU path
        # (`apply_top_k_only`) takes `k.max()` of the empty per-row k and raises.
        return logits
    temperature = sampling_metadata.temperature
    temperature = torch.where(temperature == GREEDY_TEMPERATURE, 1.0, temperature)
    logits.div_(expand_to_draft_rows(temperature, num_draft_tokens).unsqueeze(1))

    min_p = _min_p_of(sampling_metadata)
    if min_p is not None:
        # MinPLogitsProcessor.apply, per draft row.
        probs = logits.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True).mul_(
            expand_to_draft_rows(min_p, num_draft_tokens).unsqueeze(1)
        )
        logits.masked_fill_(probs < threshold, float("-inf"))

    top_k = sampling_metadata.top_k
    top_p = sampling_metadata.top_p
    # vLLM's function, bit for bit, without its per-row sort with indices on CPU
    # (top_k_top_p.py): every verified draft of a sampled request is a row here.
    return apply_top_k_top_p_values_sorted(
        logits,
        None if top_k is None else expand_to_draft_rows(top_k, num_draft_tokens),
        None if top_p is None else expand_to_draft_rows(top_p, num_draft_tokens),
    )


def samples_as_plain_decoding(metadata: SpecDecodeMetadata,
                              sampling_metadata: SamplingMetadata) -> bool:
    """Whether `SparseRejectionSampler` samples this step as plain decoding does: no
    request verifies a draft (dynamic verification skipped them all) and no logprobs are
    asked for. Each request's token is then its bonus token, vLLM's own sampler on its
    one row; the rejection path would add nothing but a [num_reqs, vocab] exponential
    draw from the global RNG for recovered tokens that no row can need (seeded
    generators are not touched there either for rows without drafts). No q is needed."""
    return metadata.max_spec_len == 0 and sampling_metadata.max_num_logprobs is None


class SparseRejectionSampler(RejectionSampler):
    """vLLM's `RejectionSampler` verifying against a sparse (top-k) draft q."""

    # How the recovered tokens' randomness is drawn (docs/verify.md): "inverse_cdf", one
    # uniform per request with drafts (what serving runs; CPU, elsewhere "drafted");
    # "drafted", vLLM's exponentials for the requests with drafts only; "vllm", vLLM's
    # exponentials for every row, for comparing with vLLM token for token.
    recovered_draw = "inverse_cdf"
    # Steps that allow it are verified position by position (`verifies_row_by_row`);
    # False processes every draft row, for comparing the two.
    row_by_row = True

    def forward(  # type: ignore[override]
        self,
        metadata: SpecDecodeMetadata,
        draft_cand_ids: torch.Tensor | None,  # [num_tokens, topk] int64, -1 = pad
        draft_cand_probs: torch.Tensor | None,  # [num_tokens, topk] float32
        logits: torch.Tensor,  # [num_tokens + num_reqs, V]
        sampling_metadata: SamplingMetadata,
    ) -> SamplerOutput:
        """Returns vLLM's SamplerOutput: [num_reqs, max_spec_len + 1] int32 tokens
        (-1 after the correction/bonus token) and logprobs if requested.

        draft_cand_ids/probs may be None for an all-greedy batch."""
        assert metadata.max_spec_len <= MAX_SPEC_LEN
        if self.synthetic_mode:
            raise ValueError(
                "rejection_sample_method='synthetic' is not supported by the dspine "
                "verifier; use the default rejection sampling."
            )
        _check_logits_processors(sampling_metadata)
        num_draft_tokens = metadata.num_draft_tokens

        if samples_as_plain_decoding(metadata, sampling_metadata):
            bonus = self.sampler(logits=logits[metadata.bonus_logits_indices],
                                 sampling_metadata=sampling_metadata,
                                 predict_bonus_token=True)
            return SamplerOutput(sampled_token_ids=bonus.sampled_token_ids.to(torch.int32),
                                 logprobs_tensors=None)

        if self.verifies_row_by_row(sampling_metadata, logits):
            bonus = self.sampler(logits=logits[metadata.bonus_logits_indices],
                                 sampling_metadata=sampling_metadata,
                                 predict_bonus_token=True)
            return SamplerOutput(
                sampled_token_ids=self._sample_row_by_row(
                    metadata, draft_cand_ids, draft_cand_probs, logits,
                    bonus.sampled_token_ids, sampling_metadata),
                logprobs_tensors=None)

        # Bonus tokens: vLLM's own sampler on the bonus rows (as RejectionSampler).
        bonus_logits = logits[metadata.bonus_logits_indices]
        bonus_sampler_output = self.sampler(
            logits=bonus_logits,
            sampling_metadata=replace(sampling_metadata, max_num_logprobs=-1),
            predict_bonus_token=True,
            logprobs_mode_override="processed_logits"
            if self.is_processed_logprobs_mode
            else "raw_logits",
        )
        bonus_token_ids = bonus_sampler_output.sampled_token_ids  # [num_reqs, 1]

        raw_target_logits = logits[metadata.target_logits_indices].to(torch.float32)
        target_logits = raw_target_logits
        if not self.is_processed_logprobs_mode:
            target_logits = target_logits.clone()
        target_logits = apply_logit_bias_to_drafts(
            target_logits, sampling_metadata, num_draft_tokens
        )
        target_logits = self.apply_logits_processors(
            target_logits, sampling_metadata, metadata
        )
        target_logits = apply_draft_sampling_constraints(
            target_logits, num_draft_tokens, sampling_metadata
        )  # [num_tokens, V]

        output_token_ids = self._sample(
            metadata, draft_cand_ids, draft_cand_probs, target_logits,
            bonus_token_ids, sampling_metadata,
        )

        logprobs_tensors = None
        if sampling_metadata.max_num_logprobs is not None:
            logprobs_tensors = self._get_logprobs_tensors(
                sampling_metadata.max_num_logprobs,
                metadata,
                logits,
                target_logits if self.is_processed_logprobs_mode else raw_target_logits,
                bonus_sampler_output.logprobs_tensors.logprobs,
                output_token_ids,
            )
        return SamplerOutput(
            sampled_token_ids=output_token_ids, logprobs_tensors=logprobs_tensors
        )

    def verifies_row_by_row(self, sampling_metadata: SamplingMetadata,
                            logits: torch.Tensor) -> bool:
        """Whether this step's drafts are verified position by position, each draft row
        processed (temperature, top-k/top-p, softmax) only while its request has not
        rejected: every request random, on CPU, with the inverse-CDF draw, and nothing
        that needs all rows at once (logprobs, penalties, bad words, allowed ids, logit
        bias, min-p, min-tokens, a thinking budget). Rows after a request's first
        rejection cannot change its tokens, so the tokens are the whole-batch path's,
        bit for bit (tests/test_verify_sampler.py); on this CPU a row costs ~0.4-0.6 ms
        (its top-p), and at chat's acceptance most rows of a step come after a
        rejection (docs/verify.md, "The recovered tokens by inverse CDF, and
        verification row by row")."""
        if not (self.row_by_row and logits.device.type == "cpu"
                and self.recovered_draw == "inverse_cdf"
                and sampling_metadata.all_random
                and sampling_metadata.max_num_logprobs is None
                and sampling_metadata.no_penalties
                and not sampling_metadata.bad_words_token_ids
                and sampling_metadata.allowed_token_ids_mask is None
                and _min_p_of(sampling_metadata) is None):
            return False
        holder = getattr(sampling_metadata, "thinking_budget_state_holder", None)
        if holder is not None and holder.has_tracked_requests():
            return False
        for processor in sampling_metadata.logitsprocs.non_argmax_invariant:
            if isinstance(processor, LogitBiasLogitsProcessor) and processor.biases:
                return False
            if isinstance(processor, MinTokensLogitsProcessor) and processor.min_toks:
                return False
        return True

    def _sample_row_by_row(
        self,
        metadata: SpecDecodeMetadata,
        draft_cand_ids: torch.Tensor | None,  # [num_tokens, topk]
        draft_cand_probs: torch.Tensor | None,  # [num_tokens, topk]
        logits: torch.Tensor,  # [num_tokens + num_reqs, V]
        bonus_token_ids: torch.Tensor,  # [num_reqs, 1]
        sampling_metadata: SamplingMetadata,
    ) -> torch.Tensor:
        """`_sample` for a step `verifies_row_by_row` accepts: the same draws (every
        draft row's uniform, then one uniform per drafted request), the same formulas
        per row, and at position j only the rows of requests that accepted positions
        0 .. j - 1. Returns [num_reqs, max_spec_len + 1] int32."""
        if draft_cand_ids is None or draft_cand_probs is None:
            raise ValueError(
                "a batch with random (temperature > 0) requests needs the sparse "
                "draft distribution; pass draft_cand_ids and draft_cand_probs."
            )
        device = logits.device
        num_draft_tokens = metadata.num_draft_tokens
        num_reqs = len(num_draft_tokens)
        num_tokens = sum(num_draft_tokens)
        if (draft_cand_ids.ndim != 2 or draft_cand_ids.shape != draft_cand_probs.shape
                or draft_cand_ids.shape[0] != num_tokens):
            raise ValueError(
                f"draft_cand_ids {tuple(draft_cand_ids.shape)} and draft_cand_probs "
                f"{tuple(draft_cand_probs.shape)} must both be [{num_tokens}, topk]: one "
                "row of candidates per draft token."
            )
        generators = sampling_metadata.generators
        uniform_probs = generate_uniform_probs(
            num_tokens, num_draft_tokens, generators, device)  # [num_tokens]
        recovered_uniforms = generate_recovered_uniforms(
            num_draft_tokens, generators, device)  # [num_reqs]
        cand_ids, cand_probs = drop_invalid_q(draft_cand_ids, draft_cand_probs)
        drafts = metadata.draft_token_ids.long()  # [num_tokens]
        target_rows = metadata.target_logits_indices.long()  # [num_tokens]
        temperature = sampling_metadata.temperature
        temperature = torch.where(temperature == GREEDY_TEMPERATURE, 1.0, temperature)
        top_k, top_p = sampling_metadata.top_k, sampling_metadata.top_p

        starts = [0] * num_reqs  # each request's first draft row
        for r in range(1, num_reqs):
            starts[r] = starts[r - 1] + num_draft_tokens[r - 1]
        bonus = bonus_token_ids.reshape(num_reqs).tolist()
        tokens: list[list[int]] = [[] for _ in range(num_reqs)]
        alive = [r for r in range(num_reqs) if num_draft_tokens[r] > 0]
        for r in range(num_reqs):
            if num_draft_tokens[r] == 0:
                tokens[r].append(bonus[r])
        for j in range(metadata.max_spec_len):
            if not alive:
                break
            reqs = torch.tensor(alive, dtype=torch.int64, device=device)  # [a]
            rows = torch.tensor([starts[r] + j for r in alive], dtype=torch.int64,
                                device=device)  # [a]  draft rows at position j
            x = logits[target_rows[rows]].to(torch.float32)  # [a, V]  a copy
            x.div_(temperature[reqs].unsqueeze(1))
            x = apply_top_k_top_p_values_sorted(
                x, None if top_k is None else top_k[reqs],
                None if top_p is None else top_p[reqs])
            probs = x.softmax(dim=-1, dtype=torch.float32)  # [a, V]
            draft = drafts[rows]  # [a]
            ids, q_probs = cand_ids[rows], cand_probs[rows]  # [a, topk]
            accepted = sampled_drafts_accepted(draft, ids, q_probs, probs,
                                               uniform_probs[rows]).tolist()
            rejected = [i for i, ok in enumerate(accepted) if not ok]
            if rejected:
                local = torch.tensor(rejected, dtype=torch.int64, device=device)
                recovered = sparse_recovered_tokens_inverse_cdf(
                    local, reqs[local], ids, q_probs, probs, recovered_uniforms).tolist()
                for i, token in zip(rejected, recovered):
                    tokens[alive[i]].append(token)
            draft_list = draft.tolist()
            still = []
            for i, r in enumerate(alive):
                if accepted[i]:
                    tokens[r].append(draft_list[i])
                    if j + 1 == num_draft_tokens[r]:
                        tokens[r].append(bonus[r])  # every draft accepted
                    else:
                        still.append(r)
            alive = still
        width = metadata.max_spec_len + 1
        return torch.tensor(
            [t + [PLACEHOLDER_TOKEN_ID] * (width - len(t)) for t in tokens],
            dtype=torch.int32, device=device)

    def _sample(
        self,
        metadata: SpecDecodeMetadata,
        draft_cand_ids: torch.Tensor | None,  # [num_tokens, topk]
        draft_cand_probs: torch.Tensor | None,  # [num_tokens, topk]
        target_logits: torch.Tensor,  # [num_tokens, V], processed
        bonus_token_ids: torch.Tensor,  # [num_reqs, 1]
        sampling_metadata: SamplingMetadata,
    ) -> torch.Tensor:
        """Randomness drawn in vLLM's `rejection_sample` order: uniforms, then the
        recovered tokens' draws as `recovered_draw` says (on CPU by default one
        uniform per request with drafts, `generate_recovered_uniforms`)."""
        device = target_logits.device
        num_tokens, vocab_size = target_logits.shape
        num_draft_tokens = metadata.num_draft_tokens
        all_greedy = sampling_metadata.all_greedy
        is_greedy = None
        if not all_greedy and not sampling_metadata.all_random:
            is_greedy = sampling_metadata.temperature == GREEDY_TEMPERATURE
        target_argmax = None
        if not sampling_metadata.all_random:
            target_argmax = target_logits.argmax(dim=-1)  # [num_tokens]
        if all_greedy:
            return sparse_rejection_sample(
                metadata.draft_token_ids, num_draft_tokens, metadata.max_spec_len,
                metadata.cu_num_draft_tokens, None, None, None, bonus_token_ids,
                None, target_argmax, None, None,
            )
        if draft_cand_ids is None or draft_cand_probs is None:
            raise ValueError(
                "a batch with random (temperature > 0) requests needs the sparse "
                "draft distribution; pass draft_cand_ids and draft_cand_probs."
            )
        uniform_probs = generate_uniform_probs(
            num_tokens, num_draft_tokens, sampling_metadata.generators, device
        )
        target_probs = target_logits.softmax(dim=-1, dtype=torch.float32)
        draw = self.recovered_draw
        if draw not in ("inverse_cdf", "drafted", "vllm"):
            raise ValueError(f"recovered_draw {draw!r}: use 'inverse_cdf', 'drafted' "
                             "or 'vllm'.")
        if draw == "inverse_cdf" and device.type == "cpu":
            recovered_uniforms = generate_recovered_uniforms(
                num_draft_tokens, sampling_metadata.generators, device)  # [num_reqs]
            return sparse_rejection_sample(
                metadata.draft_token_ids, num_draft_tokens, metadata.max_spec_len,
                metadata.cu_num_draft_tokens, draft_cand_ids, draft_cand_probs,
                target_probs, bonus_token_ids, is_greedy, target_argmax,
                uniform_probs, None, recovered_uniforms=recovered_uniforms,
            )
        # "drafted": rows only for requests with drafts (the others cannot reject).
        inv_exp = generate_inv_exp(
            num_draft_tokens, vocab_size, sampling_metadata.generators, device,
            torch.float64 if self.use_fp64_gumbel else torch.float32,
            drafted_only=draw != "vllm",
        )  # [num_reqs, V]
        return sparse_rejection_sample(
            metadata.draft_token_ids, num_draft_tokens, metadata.max_spec_len,
            metadata.cu_num_draft_tokens, draft_cand_ids, draft_cand_probs,
            target_probs, bonus_token_ids, is_greedy, target_argmax, uniform_probs,
            inv_exp,
        )
