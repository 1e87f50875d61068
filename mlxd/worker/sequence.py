"""A request inside a model's core: its status, its stop strings and detokenizer, the
processors that shape its logits, and the core's counters."""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlxd.cache.lease import PrefixLease
from mlxd.executor.stops import StopMatcher
from mlxd.types import Event, GenerationRequest

log = logging.getLogger("mlxd.scheduler")

# A VLM's image prompt, prefilled by the model itself on the model thread (the token-only
# executor cannot take its input embeddings): returns the filled KV cache and the prompt ids
# still to feed (the last one), so the sequence then decodes in the shared batch.
MediaPrefill = Callable[[], tuple[list[Any], list[int]]]


class SequenceStatus(enum.IntEnum):
    """A sequence's life; every status from FINISHED_STOPPED on is final."""

    WAITING = 0  # queued for admission
    PREFILLING = 1  # in the executor, no token yet
    DECODING = 2
    FINISHED_STOPPED = 3  # end of sequence token or stop string
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED


FINAL_STATUS = {
    "stop": SequenceStatus.FINISHED_STOPPED,
    "length": SequenceStatus.FINISHED_LENGTH,
    "cancelled": SequenceStatus.FINISHED_ABORTED,
    "error": SequenceStatus.FINISHED_ERROR,
}


@dataclass(eq=False)
class Sequence:
    """One request inside the core. `reply` is where its events go: opaque to the core."""

    request: GenerationRequest
    prompt_ids: list[int]
    reply: Any = None
    status: SequenceStatus = SequenceStatus.WAITING
    uid: int = -1  # the core's id for it, from `add` on
    computed: int = 0  # prompt tokens in its KV cache, once admitted
    completion_tokens: int = 0
    stops: StopMatcher = field(init=False)
    detokenizer: Any = None
    # Extra per-sequence logits processors (constrained decoding), built off the model thread.
    processors: list[Any] = field(default_factory=list)
    # Set when this sequence's own work (logits processors, detokenizer, stops) raised: it
    # alone fails, after the step.
    fault: str | None = None
    prefill: MediaPrefill | None = None  # image prompts bypass the prefix cache
    lease: PrefixLease | None = None
    slot: int = 0  # its LoRA adapter's slot in a multi-LoRA model (0: the base)

    def __post_init__(self) -> None:
        self.stops = StopMatcher(self.request.stop)


Output = tuple[Sequence, Event]


@dataclass
class CoreStats:
    steps: int = 0
    # Decode steps that carried more than one sequence: proof the batching batches.
    multi_sequence_steps: int = 0
    max_batch_seen: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0


def guarded(sequence: Sequence, processors: list[Any]) -> list[Any]:
    """The sequence's logits processors as one that records an exception on the sequence
    instead of raising it out of the batched step (which would fail every sequence)."""
    if not processors:
        return []  # no processors keeps mlx-lm's fast path

    def process(tokens: Any, logits: Any) -> Any:
        if sequence.fault is not None:
            return logits
        try:
            for processor in processors:
                logits = processor(tokens, logits)
        except Exception as exc:
            log.exception("logits processor of a sequence failed")
            sequence.fault = f"{type(exc).__name__}: {exc}"
        return logits

    return [process]
