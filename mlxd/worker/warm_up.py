"""The shapes a GPU backend compiles kernels for, run once while the model loads.

MLX's CUDA backend compiles a kernel the first time it meets a new shape class: on a fresh
H200 the first request waited 45–50 s for its first token, and the first batch of 8 and the
first top-p draw stalled another 30–35 s each (docs/performance.md). Those waits belong to the
load, where the model is not yet routed to: the engine runs these rounds through its own core
before it reports ready, and MLX keeps what it compiled on disk (on CUDA, `worker/jit_cache.py`),
so a later load of any model on the machine compiles little or nothing. The CPU backend compiles
nothing worth a warm-up.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from mlxd.config import BatchConfig
from mlxd.executor.speculative import SpeculativeCounters
from mlxd.types import Finished, GenerationRequest, SamplingParams
from mlxd.worker.sequence import CoreStats, Sequence

if TYPE_CHECKING:
    from mlxd.worker.llm_core import LLMCore

log = logging.getLogger("mlxd.scheduler")

GREEDY = SamplingParams(temperature=0.0)
# The common sampled request (OpenAI's and Ollama's clients send these): its top-p draw has
# kernels of its own.
TOP_P = SamplingParams(temperature=0.7, top_p=0.9)
SHORT_PROMPT = 8
# Past the prompt's first token: decode steps at the round's batch size, unless the model
# ends a sequence at once.
MAX_TOKENS = 3
TEXT = "The quick brown fox jumps over the lazy dog, then naps in the warm afternoon sun. "


def batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, … up to and with `max_batch_size`: a kernel's variant changes with the rows'
    order of magnitude, not with each count."""
    sizes = [1 << i for i in range(max_batch_size.bit_length()) if 1 << i <= max_batch_size]
    return sizes if sizes[-1] == max_batch_size else [*sizes, max_batch_size]


def prompt_lengths(step: int) -> list[int]:
    """One row's prompt lengths: 8, 16, 32, … up to one prefill step, and the step itself."""
    lengths = list(itertools.takewhile(lambda n: n < step, (SHORT_PROMPT << i for i in range(32))))
    return [*lengths, step]


def rounds(
    tokenizer: Any, batch: BatchConfig, context_length: int, model: str
) -> list[list[GenerationRequest]]:
    """Each round is run to its end before the next, so its requests decode as one batch: one
    row greedy at each of `prompt_lengths`, then, greedy and at top-p, `batch_sizes` rows at
    once whose prompts differ in length (8, 16, … 128 tokens: padded rows, as requests are)."""
    step = max(1, min(batch.prefill_step_size, context_length - MAX_TOKENS - 1))
    words = tokenizer.encode(TEXT * (1 + step // 4))
    ids = itertools.count()

    def round_of(lengths: list[int], sampling: SamplingParams) -> list[GenerationRequest]:
        prompts = [words[: min(length, step)] for length in lengths]
        # The first rows decode while the later ones are prefilled (a step each at most):
        # they must still run when the last joins, for a step of all of them.
        tokens = MAX_TOKENS + len(prompts)
        return [
            GenerationRequest(
                request_id=f"warm-up-{next(ids)}",
                model=model,
                max_tokens=max(1, min(tokens, context_length - len(prompt))),
                sampling=sampling,
                prompt=prompt,
            )
            for prompt in prompts
        ]

    plan = [round_of([length], GREEDY) for length in prompt_lengths(step)]
    # More than max_queue at once would be refused (429), as requests are.
    for size in batch_sizes(min(batch.max_batch_size, batch.max_queue)):
        lengths = [SHORT_PROMPT << (row % 5) for row in range(size)]
        plan += [round_of(lengths, GREEDY), round_of(lengths, TOP_P)]
    return plan


def run(
    core: LLMCore, plan: list[list[GenerationRequest]], stop: threading.Event
) -> list[tuple[int, float]]:
    """Each round through the core's scheduler and executor, as requests would go, to its end,
    on the model thread; what they produced is dropped and the core's counters start at zero
    after them. They hold no prefix-cache lease, so the cache never sees them. Returns each
    round's most rows in a step and its seconds (what compiled)."""
    done = []
    for requests in plan:
        if stop.is_set():
            break
        started = time.perf_counter()
        error = _run_to_end(core, requests)
        done.append((core.stats.max_batch_seen, time.perf_counter() - started))
        core.stats = CoreStats()
        if error is not None:  # what a request would meet too: said, and the model serves
            log.warning("model '%s': warm-up stopped: %s", core.name, error)
            break
    if core.speculator is not None:
        core.speculator.counters = SpeculativeCounters()
    return done


def _run_to_end(core: LLMCore, requests: list[GenerationRequest]) -> str | None:
    """Step until `requests` are done; the first failure's error ends them all."""
    for request in requests:
        assert isinstance(request.prompt, list), "warm-up prompts are token ids"
        core.add(Sequence(request, request.prompt))
    while core.has_work:
        for _, event in core.step():
            if isinstance(event, Finished) and event.error is not None:
                core.fail_batch("warm-up stopped")
                return event.error
    return None
