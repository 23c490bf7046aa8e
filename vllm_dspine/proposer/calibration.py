"""Acceptance calibration for the dynamic-verification policy (`dynamic.py`,
docs/dynamic-verification.md): the confidence the policy reads off the tail per draft
(`draft_confidence`), and the map from that confidence to the acceptance vLLM actually
observed (`AcceptanceCalibrator`).

    R requests, K draft positions, k candidates per position.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def draft_confidence(
    S: torch.Tensor,  # [R, K, k, k]  the tail's score tables
    cand_ids: torch.Tensor,  # [R, K, k]
    cand_probs: torch.Tensor,  # [R, K, k]  q each draft was drawn from (greedy: one-hot)
    draft_ids: torch.Tensor,  # [R, K]
    greedy: torch.Tensor,  # [R] bool
) -> torch.Tensor:  # [R, K] float32 in [0, 1]
    """The confidence the policy reads per draft position.

    Greedy rows: softmax (temperature 1) of the table row the walk used,
    S[t](v_{t-1}, .), at the chosen candidate (its argmax): the tail's own probability of
    its choice. Sampled rows: max_v q_t(v | v_{t-1}), the peak of the distribution the
    draft was drawn from; known before the draw, as losslessness needs (`dynamic.py`)."""
    R, K, k = cand_ids.shape
    chosen = (cand_ids == draft_ids[..., None]).to(torch.int8).argmax(dim=-1)  # [R, K]
    prev = torch.cat([torch.zeros_like(chosen[:, :1]), chosen[:, :-1]], dim=1)  # [R, K]
    rows = S.gather(2, prev[:, :, None, None].expand(R, K, 1, k)).squeeze(2)  # [R, K, k]
    p = torch.softmax(rows.double(), dim=-1).gather(2, chosen[..., None]).squeeze(2)
    peak = cand_probs.double().amax(dim=-1)
    return torch.where(greedy.to(S.device)[:, None], p, peak).float()


class AcceptanceCalibrator:
    """alpha = P(draft t accepted | drafts < t accepted, confidence c), per kind (greedy
    or sampled), position group (draft 1, 2-3, 4-7, 8-15) and confidence bin. A bin
    follows the acceptances vLLM reports from a prior of two pseudo-observations at the
    acceptance seen over its whole kind and group (itself starting from the bin's
    confidence); old observations fade (counts halve past 400)."""

    EDGES = np.array([0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0])
    # The bins fall into POOLS equal runs; a bin with few observations leans on its own
    # run only (one run: all bins; the lookup's calibrator keeps its two kinds of match
    # apart, lookup.py).
    POOLS = 1
    PRIOR = 2.0
    MAX_TRIALS = 400.0

    def __init__(self, num_positions: int) -> None:
        nb = len(self.EDGES) - 1
        self._group = np.array([min(int(math.log2(t + 1)), 4) for t in range(num_positions)])
        centers = (self.EDGES[:-1] + self.EDGES[1:]) / 2
        self._prior = np.broadcast_to(centers, (2, 5, nb)).copy()
        self.success = np.zeros((2, 5, nb))
        self.trials = np.zeros((2, 5, nb))
        self._pooled = self._pooled_prior()  # refreshed by observe_many

    def _bin(self, conf: np.ndarray) -> np.ndarray:
        return np.clip(np.searchsorted(self.EDGES, conf, side="right") - 1, 0,
                       len(self.EDGES) - 2)

    def predict(self, conf: np.ndarray, greedy: np.ndarray) -> np.ndarray:
        """conf [R, K] in [0, 1], greedy [R] bool -> alpha [R, K]."""
        R, K = conf.shape
        kind = np.where(greedy, 0, 1)[:, None].repeat(K, axis=1)
        group = np.broadcast_to(self._group[:K], (R, K))
        b = self._bin(conf)
        s, n = self.success[kind, group, b], self.trials[kind, group, b]
        return (s + self.PRIOR * self._pooled[kind, group, b]) / (n + self.PRIOR)

    def _pooled_prior(self) -> np.ndarray:
        """[2, 5, bins]: what a bin with few observations leans on: the acceptance
        observed over all bins of its kind and position group (the bin's own confidence
        counting as PRIOR observations). A bin's raw confidence alone was optimistic by
        ~40 % on SmolLM2's drafter, whose tail probabilities are overconfident (docs/
        dynamic-verification.md)."""
        shape = self.success.shape  # [2 kinds, 5 groups, bins]
        runs = (shape[0], shape[1], self.POOLS, shape[2] // self.POOLS)

        def pooled(x: np.ndarray) -> np.ndarray:
            return np.broadcast_to(x.reshape(runs).sum(-1, keepdims=True), runs).reshape(shape)

        return (pooled(self.success) + self.PRIOR * self._prior) / (
            pooled(self.trials) + self.PRIOR)

    def observe(self, conf: np.ndarray, greedy: bool, accepted: int, verified: int) -> None:
        """One verification: drafts 0..accepted-1 accepted, draft `accepted` rejected
        (if accepted < verified); later drafts were not tested."""
        self.observe_many([(conf, greedy, accepted, verified)])

    def observe_many(self, verifications) -> None:
        """observe() for several (conf, greedy, accepted, verified) at once."""
        kinds, groups, bins, hits = [], [], [], []
        for conf, greedy, accepted, verified in verifications:
            tested = min(accepted + 1, verified)
            if tested <= 0:
                continue
            t = np.arange(tested)
            kinds.append(np.full(tested, 0 if greedy else 1))
            groups.append(self._group[t])
            bins.append(self._bin(np.asarray(conf[:tested])))
            hits.append((t < accepted).astype(np.float64))
        if not kinds:
            return
        idx = (np.concatenate(kinds), np.concatenate(groups), np.concatenate(bins))
        np.add.at(self.trials, idx, 1.0)
        np.add.at(self.success, idx, np.concatenate(hits))
        full = self.trials > self.MAX_TRIALS
        if full.any():
            self.trials[full] /= 2
            self.success[full] /= 2
        self._pooled = self._pooled_prior()
