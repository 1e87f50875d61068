"""Speculative decoding inside the continuous batch: prompt-lookup drafts and per-row rollback.

A speculative step feeds each row its pending token followed by its drafts (rows pad to the
longest), samples every position with the row's own sampler and keeps drafts while they equal
what was sampled at the position before them; the first mismatch is replaced by the sampled
token, which becomes the row's next pending token. Comparing the draft with a sample of the
target distribution is the standard rejection rule for a draft that is a point mass (as
prompt lookup's is): the draft survives with probability p(d) and, when it does not, the
sample is distributed as p without d, renormalised. So greedy output is the plain decoder's
token for token, and sampled output keeps its distribution.

Rows keep different numbers of tokens while mlx-lm's `BatchKVCache` has one write position
for all rows. Each row's rejected tail is rolled into its left padding (the same roll mlx-lm
applies after right-padded prefill): `left_padding` masks it and the row's `offset` (its RoPE
position) drops by as much, so the row's cache is exactly the plain decoder's, shifted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from mlx_lm.models.cache import BatchKVCache
from numpy.lib.stride_tricks import sliding_window_view

from mlxd.config import SpeculativeConfig

LONGEST_NGRAM = 3


@dataclass
class SpeculativeCounters:
    draft_tokens: int = 0  # drafts verified
    accepted_tokens: int = 0  # drafts the model agreed with

    def as_dict(self) -> dict[str, Any]:
        rate = self.accepted_tokens / self.draft_tokens if self.draft_tokens else None
        return {
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": rate,
        }


@dataclass
class RowDrafting:
    length: int  # most drafts next time
    shortest: int = 1  # shortest suffix match worth drafting from


class NgramSpeculator:
    """Prompt lookup: drafts copied from earlier in the sequence itself, no second model.

    Each row drafts one token more than it accepted last time (up to num_tokens), and after a
    step that accepted nothing only from a match of the longest suffix: a row copying its
    prompt keeps long drafts, a row writing new text mostly decodes plainly (a speculative
    step is synchronous, so it also loses the overlap of host work with the next step).
    """

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.counters = SpeculativeCounters()
        self._rows: dict[int, RowDrafting] = {}  # by the generator's uid

    def active(self, batch_size: int, caches: list[Any]) -> bool:
        # Exactly BatchKVCache: quantized or rotating caches have no per-row rollback here.
        return batch_size <= self.config.disable_by_batch_size and all(
            type(c) is BatchKVCache for c in caches
        )

    def propose(self, uid: int, tokens: list[int], limit: int) -> list[int]:
        row = self._rows.get(uid) or RowDrafting(self.config.num_tokens)
        return ngram_drafts(tokens, min(limit, row.length), shortest=row.shortest)

    def record(self, uid: int, drafted: int, accepted: int) -> None:
        self.counters.draft_tokens += drafted
        self.counters.accepted_tokens += accepted
        shortest = 1 if accepted else LONGEST_NGRAM
        self._rows[uid] = RowDrafting(min(accepted + 1, self.config.num_tokens), shortest)

    def retain(self, uids: list[int]) -> None:
        """Forget the rows that left the batch."""
        if self._rows.keys() - set(uids):
            self._rows = {uid: row for uid, row in self._rows.items() if uid in uids}


def ngram_drafts(
    tokens: list[int], count: int, longest: int = LONGEST_NGRAM, shortest: int = 1
) -> list[int]:
    """Up to `count` tokens that followed the latest earlier occurrence of the sequence's last
    n tokens (longest n first, down to `shortest`); none when no suffix occurred before."""
    if count <= 0 or len(tokens) < 2:
        return []
    sequence = np.asarray(tokens, dtype=np.int64)
    for n in range(min(longest, len(sequence) - 1), shortest - 1, -1):
        # Windows that end before the last token, so each has a following token.
        windows = sliding_window_view(sequence[:-1], n)
        hits = np.flatnonzero((windows == sequence[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return [int(t) for t in sequence[start : start + count]]
    return []


def accepted_count(drafts: list[int], sampled: list[int]) -> int:
    """How many leading drafts equal the token sampled at the position before each."""
    count = 0
    while count < len(drafts) and drafts[count] == sampled[count]:
        count += 1
    return count


def roll_back(caches: list[Any], rejected: list[int]) -> None:
    """Drop each row's last `rejected[row]` cache positions: the part every row rejected is
    trimmed, the rest rolled into the row's left padding."""
    common = min(rejected)
    extra = [r - common for r in rejected]
    for cache in caches:
        if common:
            cache.trim(common)
        if any(extra):
            cache.prepare(right_padding=extra)
            cache.finalize()
