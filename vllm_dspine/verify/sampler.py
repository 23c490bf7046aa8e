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
    RejectionSampler,
)
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

from vllm_dspine.verify.sparse_rejection import sparse_rejection_sample
from vllm_dspine.verify.top_k_top_p import apply_top_k_top_p_values_sorted
from vllm_dspine.verify.sparse_rejection_ref import (
    generate_inv_exp,
    generate_uniform_probs,
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

    # The recovered tokens' exponentials for requests with drafts only (docs/verify.md);
    # False draws vLLM's every row, for comparing with vLLM token for token.
    drafted_only_exponentials = True

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
        per-request exponentials, these only for requests with drafts
        (`generate_inv_exp(..., drafted_only=True)`)."""
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
        # Rows only for requests with drafts (the others cannot reject).
        inv_exp = generate_inv_exp(
            num_draft_tokens, vocab_size, sampling_metadata.generators, device,
            torch.float64 if self.use_fp64_gumbel else torch.float32,
            drafted_only=self.drafted_only_exponentials,
        )
        return sparse_rejection_sample(
            metadata.draft_token_ids, num_draft_tokens, metadata.max_spec_len,
            metadata.cu_num_draft_tokens, draft_cand_ids, draft_cand_probs,
            target_probs, bonus_token_ids, is_greedy, target_argmax, uniform_probs,
            inv_exp,
        )
