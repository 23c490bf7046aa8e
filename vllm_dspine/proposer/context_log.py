"""Context K/V writes of steps that ran no block, applied late and in one batch.

A step whose drafts nobody verifies skips the block forward but must still write the
draft context K/V of its newly committed positions (later blocks attend to them). That
write runs one or a few tokens a step, and at that size it costs the fc and K/V
projections' weight reads. Where the draft KV cache's blocks are freed only when
requests finish or are preempted, the writes can wait: `ContextLog` keeps them and
applies them in order, as one batch, before anything reads or reuses those slots.
"""

from __future__ import annotations

from typing import Callable

import torch

# Logged context K/V writes are applied once they hold this many tokens (or before the
# next block): a few hundred rows make the projections' weight reads negligible, and
# the log stays ~3 MB at SmolLM2's 5 x 576 features.
CONTEXT_LOG_TOKENS = 256

# (raw target features [n, L_aux * H], positions [n], slots [n]) -> None
ContextWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


class ContextLog:
    """Context K/V writes not yet applied, oldest first.

    deferred=False (a sliding-window drafter frees blocks mid-request; a hybrid target's
    state pages share memory with other groups' blocks): every write is applied at once.
    deferred=True: writes are kept and applied, oldest first, as one batch by `flush`,
    which the proposer calls before the next block reads the cache and before a step
    whose scheduler freed blocks (its forward may write into them); and by `add` once
    CONTEXT_LOG_TOKENS are kept. Applied in order, a slot written twice ends as the
    eager writes would leave it.
    """

    def __init__(self, write: ContextWrite, deferred: bool,
                 flush_tokens: int = CONTEXT_LOG_TOKENS) -> None:
        self._write = write
        self.deferred = deferred
        self.flush_tokens = flush_tokens
        self._entries: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, hidden: torch.Tensor,  # [n, L_aux * H] raw target features
            positions: torch.Tensor,  # [n]
            slots: torch.Tensor,  # [n]
            ) -> None:
        if not self.deferred:  # eager: written now, nothing kept
            self._write(hidden, positions, slots)
            return
        # Kept past this step: copies (the caller's buffers are reused).
        self._entries.append((hidden.clone(), positions.clone(), slots.clone()))
        self.num_tokens += hidden.shape[0]
        if self.num_tokens >= self.flush_tokens:
            self.flush()

    def flush(self) -> None:
        """Writes the kept context K/V (oldest first, as one batch)."""
        if not self._entries:
            return
        entries, self._entries, self.num_tokens = self._entries, [], 0
        self._write(*(torch.cat(parts) for parts in zip(*entries)))
