"""The shapes a GPU backend compiles kernels for, run once while the model loads.

MLX's CUDA backend compiles a kernel the first time it meets a new shape class: on a fresh
H200 the first request waited 45–50 s for its first token, and the first batch of 8 and the
first top-p draw stalled another 30–35 s each (docs/performance.md). Those waits belong to the
load, where the model is not yet routed to: the engine runs these rounds through its own core
before it reports ready, and MLX keeps what it compiled on disk (`accel.keep_jit_cache`), so a
later load of any model on the machine compiles little or nothing. The CPU backend compiles
nothing worth a warm-up.
"""

from __future__ import annotations

import itertools
from typing import Any

from mlxd.config import BatchConfig
from mlxd.types import GenerationRequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0)
# The common sampled request (OpenAI's and Ollama's clients send these): its top-p draw has
# kernels of its own.
TOP_P = SamplingParams(temperature=0.7, top_p=0.9)
SHORT_PROMPT = 8
# Past the prompt's first token: at least one decode step at the round's batch size, unless
# the model ends a sequence at once.
MAX_TOKENS = 3
TEXT = "The quick brown fox jumps over the lazy dog, then naps in the warm afternoon sun. "


def batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, … up to and with `max_batch_size`: a kernel's variant changes with the rows'
    order of magnitude, not with each count."""
    sizes = [1 << i for i in range(max_batch_size.bit_length()) if 1 << i <= max_batch_size]
    return sizes if sizes[-1] == max_batch_size else [*sizes, max_batch_size]


def rounds(
    tokenizer: Any, batch: BatchConfig, context_length: int, model: str
) -> list[list[GenerationRequest]]:
    """Each round is run to its end before the next, so its requests decode as one batch: a
    prompt of one full prefill step alone, then, greedy and at top-p, `batch_sizes` short
    prompts at once."""
    words = tokenizer.encode(TEXT * (1 + batch.prefill_step_size // 8))
    long_prompt = min(batch.prefill_step_size, context_length - MAX_TOKENS - 1, len(words))
    ids = itertools.count()

    def request(length: int, sampling: SamplingParams) -> GenerationRequest:
        return GenerationRequest(
            request_id=f"warm-up-{next(ids)}",
            model=model,
            max_tokens=MAX_TOKENS,
            sampling=sampling,
            prompt=words[:length],
        )

    plan = [[request(long_prompt, GREEDY)]]
    for size in batch_sizes(batch.max_batch_size):
        for sampling in (GREEDY, TOP_P):
            plan.append([request(SHORT_PROMPT, sampling) for _ in range(size)])
    return plan
