"""Prompts being prefilled: forward passes that fill the rows' KV caches.

Prompts of different lengths in one pass are right-padded, and the caches rolled to left
padding after it (`finalize_used_span` rolls only the positions in use). A prompt's last
chunk can take its last token along and return the logits there (`last_logits`), where the
model projects last positions alone (`SkipPrefillLogits.projects_last`): the first token is
then sampled from the prefill, with no decode step of its own, as in llama.cpp.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import mlx.core as mx

from mlxd.executor.rows import Row, RowBatch, finalize_used_span, select_rows

# Positions per forward pass, at most (mlx-lm's default): the scheduler's chunks are
# usually smaller.
PREFILL_STEP = 2048


class PromptBatch(RowBatch):
    def split(self, indices: list[int]) -> PromptBatch:
        """The rows at `indices` as a batch of their own, removed from this one. When every
        row moves (prompts that end together) the batch moves as it is: no KV copied."""
        if sorted(indices) == list(range(len(self.rows))):
            moved = PromptBatch(self.model, self.rows, self.cache)
            self.rows, self.cache = [], []
            return moved
        moved = PromptBatch(
            self.model,
            [self.rows[i] for i in indices],
            [select_rows(cache, indices) for cache in self.cache],
        )
        moving = set(indices)
        self.filter([i for i in range(len(self.rows)) if i not in moving])
        return moved

    def prompt(self, tokens: list[list[int]]) -> None:
        """Feed each row its tokens, at most `PREFILL_STEP` positions per forward pass."""
        self.route()
        _hold(self.rows, tokens)
        with self._right_padded(tokens) as inputs:
            while inputs.shape[1] > 0:
                self.model(inputs[:, :PREFILL_STEP], cache=self.cache)
                mx.eval([cache.state for cache in self.cache])
                mx.clear_cache()
                inputs = inputs[:, PREFILL_STEP:]
        mx.eval([cache.state for cache in self.cache])  # the roll to left padding

    def last_logits(self, tokens: list[list[int]]) -> mx.array:
        """Feed each row its tokens in one pass, each row's last prompt token among them, and
        return the logits after it (rows × vocabulary). The last tokens are not added to
        the rows' `tokens`: the decode batch adds them as it takes the rows."""
        self.route()
        _hold(self.rows, [rest[:-1] for rest in tokens])
        last = mx.array([len(t) for t in tokens]) - 1
        with self._right_padded(tokens) as inputs:
            logits = cast(Any, self.model).last_logits(inputs, self.cache, last)
        mx.eval(logits, [cache.state for cache in self.cache])
        return cast(mx.array, logits)

    @contextlib.contextmanager
    def _right_padded(self, tokens: list[list[int]]) -> Iterator[mx.array]:
        """The rows' tokens as one array for forward passes in the block: prompts of
        different lengths are right-padded, and rolled to left padding after the block."""
        lengths = [len(t) for t in tokens]
        width = max(lengths)
        padding = [width - length for length in lengths]
        if any(padding):
            for cache in self.cache:
                cache.prepare(lengths=lengths, right_padding=padding)
        yield mx.array([t + [0] * (width - len(t)) for t in tokens])
        if any(padding):
            for cache in self.cache:
                finalize_used_span(cache)


def _hold(rows: list[Row], tokens: list[list[int]]) -> None:
    for row, fed in zip(rows, tokens, strict=True):
        row.tokens += fed
