"""The prefix cache's stores of new prompts, deferred by one step (worker/llm_core.py).

The prefix cache keeps the prompt blocks of the sequences that had their first token last step,
once that token has been delivered: extracting and copying them took 17–26 ms of a 1,600-token
prompt's time to first token on SmolLM2.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Container
from typing import Any

from mlxd.executor.decode_batch import TokenOut
from mlxd.worker.sequence import Sequence


class PromptStores:
    """First responses whose prompt the prefix cache keeps at the next step. `extract(uid)`:
    a running row's per-layer KV (the executor's)."""

    def __init__(self, extract: Callable[[int], list[Any]]) -> None:
        self._extract = extract
        self._due: list[tuple[Sequence, TokenOut]] = []

    def defer(self, sequence: Sequence, response: TokenOut) -> None:
        """Keep `sequence`'s prompt, as `response` (its first token) left it, next step."""
        if sequence.lease:
            self._due.append((sequence, response))

    def store_due(self, running: Container[int]) -> None:
        """Store every deferred prompt. A sequence that went meanwhile without finishing
        (aborted, failed: not in `running`) has no KV left to keep."""
        for sequence, response in self._due:
            if response.prompt_cache is not None or sequence.uid in running:
                self._store(sequence, response)
        self._due.clear()

    def store_now(self, sequence: Sequence) -> None:
        """Keep the prompt of a sequence that leaves the executor before its deferred store
        (a stop string in its first token, an abort): its KV is gone once it is removed."""
        for entry in [e for e in self._due if e[0] is sequence]:
            self._due.remove(entry)
            self._store(*entry)

    def _store(self, sequence: Sequence, response: TokenOut) -> None:
        if sequence.lease:
            sequence.lease.store(functools.partial(self._prompt_cache, response))

    def _prompt_cache(self, response: TokenOut) -> list[Any]:
        """A sequence's per-layer KV right after its prompt (set on the response when the
        sequence already finished)."""
        if response.prompt_cache is not None:
            return response.prompt_cache
        return self._extract(response.uid)
