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

Two sources of drafts: prompt lookup (`NgramSpeculator`) and a small draft model sharing the
vocabulary (`DraftSpeculator`), which drafts greedily: its drafts are point masses too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache, trim_prompt_cache
from numpy.lib.stride_tricks import sliding_window_view

from mlxd.config import SpeculativeConfig
from mlxd.executor.nucleus import argmax

LONGEST_NGRAM = 3
DRAFT_PREFILL_TOKENS = 512  # a draft model's prompt goes in chunks of this many tokens


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


Row = TypeVar("Row")


class Speculator(Generic[Row]):
    """Drafts for the rows of a batch, each row's state kept by the generator's uid."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.counters = SpeculativeCounters()
        self._rows: dict[int, Row] = {}

    def active(self, batch_size: int, caches: list[Any]) -> bool:
        # Exactly BatchKVCache: quantized or rotating caches have no per-row rollback here.
        return batch_size <= self.config.disable_by_batch_size and all(
            type(c) is BatchKVCache for c in caches
        )

    def propose(self, uid: int, tokens: list[int], limit: int) -> list[int]:
        """At most `limit` drafts to follow `tokens` (the row's prompt, output and pending
        token)."""
        raise NotImplementedError

    def record(self, uid: int, drafted: int, accepted: int) -> None:
        """The row's verification: `accepted` of its `drafted` drafts were kept."""
        self.counters.draft_tokens += drafted
        self.counters.accepted_tokens += accepted

    def retain(self, uids: list[int]) -> None:
        """Forget the rows that left the batch."""
        if self._rows.keys() - set(uids):
            self._rows = {uid: row for uid, row in self._rows.items() if uid in uids}


class NgramSpeculator(Speculator[RowDrafting]):
    """Prompt lookup: drafts copied from earlier in the sequence itself, no second model.

    Each row drafts one token more than it accepted last time (up to num_tokens), and after a
    step that accepted nothing only from a match of the longest suffix: a row copying its
    prompt keeps long drafts, a row writing new text mostly decodes plainly (a speculative
    step is synchronous, so it also loses the overlap of host work with the next step).
    """

    def propose(self, uid: int, tokens: list[int], limit: int) -> list[int]:
        row = self._rows.get(uid) or RowDrafting(self.config.num_tokens)
        return ngram_drafts(tokens, min(limit, row.length), shortest=row.shortest)

    def record(self, uid: int, drafted: int, accepted: int) -> None:
        super().record(uid, drafted, accepted)
        shortest = 1 if accepted else LONGEST_NGRAM
        self._rows[uid] = RowDrafting(min(accepted + 1, self.config.num_tokens), shortest)


@dataclass
class DraftRow:
    cache: list[Any]  # the draft model's KV cache for this row
    fed: int = 0  # tokens in it
    proposed_after: int = 0  # the row's length when it last drafted


class DraftSpeculator(Speculator[DraftRow]):
    """A small model drafts num_tokens greedily per row, from its own KV cache of the row.

    Each proposal feeds the draft the row's tokens its cache lacks (the whole prompt the
    first time; afterwards the last step's accepted drafts' tail and the pending token), and
    after verification its cache is trimmed back to the tokens the target kept.
    """

    def __init__(self, config: SpeculativeConfig, model: Any):
        super().__init__(config)
        self.model = model

    def propose(self, uid: int, tokens: list[int], limit: int) -> list[int]:
        count = min(limit, self.config.num_tokens)
        if count <= 0:
            return []
        row = self._rows.setdefault(uid, DraftRow(make_prompt_cache(self.model)))
        missing = tokens[row.fed :]
        assert missing, "the pending token is always new to the draft"
        for start in range(0, len(missing), DRAFT_PREFILL_TOKENS):
            chunk = mx.array([missing[start : start + DRAFT_PREFILL_TOKENS]])
            logits = self.model(chunk, cache=row.cache)[:, -1, :]
        # One lazy graph for all drafts; the last one is never fed back.
        drafts = [argmax(logits)]
        for _ in range(count - 1):
            logits = self.model(drafts[-1][:, None], cache=row.cache)[:, -1, :]
            drafts.append(argmax(logits))
        row.fed = len(tokens) + count - 1
        row.proposed_after = len(tokens)
        return cast(list[int], mx.concatenate(drafts).tolist())

    def record(self, uid: int, drafted: int, accepted: int) -> None:
        super().record(uid, drafted, accepted)
        row = self._rows[uid]
        # The accepted drafts the cache holds stay (the last draft was never fed).
        kept = row.proposed_after + min(accepted, drafted - 1)
        trim_prompt_cache(row.cache, row.fed - kept)
        row.fed = kept


def make_speculator(config: SpeculativeConfig, draft_model: Any = None) -> Speculator[Any]:
    """The speculator of `config.mode`; mode draft needs the draft model loaded."""
    if config.mode == "draft":
        if draft_model is None:
            raise ValueError("speculative mode draft needs its draft model")
        return DraftSpeculator(config, draft_model)
    return NgramSpeculator(config)


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
