"""An mlx-lm logits processor that lets one sequence sample only what its grammar allows."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import cast

import llguidance
import mlx.core as mx
import numpy as np
from llguidance.mlx import apply_token_bitmask
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from mlxd.constrain.grammar import Constrainer

log = logging.getLogger("mlxd.constrain")

# llguidance's masking kernel is Metal-only; elsewhere the mask is unpacked with numpy.
_METAL = mx.metal.is_available()


class GrammarProcessor:
    """Masks one sequence's logits to the tokens its llguidance matcher accepts next.

    Stateful and single-sequence: build one per request, and call it only from the thread that
    steps the generator.
    """

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        tokenizer: llguidance.LLTokenizer,
        eos_token_ids: Iterable[int],
    ):
        self._matcher = matcher
        self._vocab_size = tokenizer.vocab_size
        self._bitmask = allocate_token_bitmask(1, self._vocab_size)
        self._words = self._bitmask.view(np.uint32)[0]
        eos = np.array(sorted(eos_token_ids), dtype=np.int64)
        self._eos = eos[eos < self._vocab_size]
        self._grammar_eos = np.array(tokenizer.eos_tokens, dtype=np.int64)
        self._eos_set = frozenset(int(t) for t in eos)
        self._seen: int | None = None  # context length at the last call
        self._ended = False

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        # Where evaluation is asynchronous (GPUs) the forward pass now runs while the mask is
        # computed below; on the CPU backend this evaluates it here instead of a moment later.
        mx.async_eval(logits)
        # mlx-lm passes the whole context, prompt included; the first call comes before any
        # generated token, and each later one brings the token(s) sampled since.
        if self._seen is not None and not self._ended:
            # tolist() is typed as any nesting of scalars; `tokens` is 1-D token ids.
            new = cast(list[int], tokens[self._seen :].tolist())
            # mlx-lm steps a sequence once more with its EOS before dropping it (that step's
            # output is discarded); the matcher, possibly already stopped, must not see it.
            self._ended = not self._eos_set.isdisjoint(new)
            if not self._ended and not self._matcher.consume_tokens(new):
                log.warning("grammar rejected a sampled token: %s", self._matcher.get_error())
        self._seen = tokens.shape[0]
        self._fill()
        if _METAL:
            return apply_token_bitmask(logits, self._bitmask)
        allowed = np.zeros(logits.shape[-1], dtype=np.bool_)
        n = min(logits.shape[-1], self._vocab_size)
        # Vocabulary ids past the tokenizer's (padded embedding rows) stay masked out.
        allowed[:n] = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[:n]
        return mx.where(mx.array(allowed), logits, mx.array(-mx.inf, logits.dtype))

    def _fill(self) -> None:
        """The next-token bitmask; EOS alone once the grammar is complete (or broken)."""
        words = self._words
        if self._ended or self._matcher.is_stopped():
            words[:] = 0
            eos_allowed = True
        else:
            fill_next_token_bitmask(self._matcher, self._bitmask)
            grammar_eos = self._grammar_eos
            eos_allowed = bool((words[grammar_eos >> 5] >> (grammar_eos & 31) & 1).any())
            # An empty mask would turn the row into NaNs; ending the sequence is the way out.
            eos_allowed = eos_allowed or not words.any()
        if eos_allowed:
            # The engine stops on any of its EOS ids; llguidance knows only its own.
            np.bitwise_or.at(words, self._eos >> 5, (1 << (self._eos & 31)).astype(np.uint32))


def make_processor(
    constrainer: Constrainer, grammar: str, eos_token_ids: Iterable[int]
) -> GrammarProcessor:
    """A fresh processor for one sequence; ValueError (llguidance's message) for a bad grammar.

    Compiling can take a while for a large schema (llguidance releases the GIL meanwhile), so
    build it off the event loop, before the request is queued.
    """
    matcher = llguidance.LLMatcher(constrainer.tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise ValueError(matcher.get_error())
    return GrammarProcessor(matcher, constrainer.tokenizer, eos_token_ids)
