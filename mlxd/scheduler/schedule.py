"""One step's plan for a batch engine: admission, prefill chunks, decode rows.

Pure: the caller (`worker.llm_core.LLMCore`) describes its queue and its running requests,
`schedule` says what the next step does, and the executor (`executor.batch.BatchExecutor`)
runs exactly that. Like vLLM v1's scheduler, a request is a count of prompt tokens computed
against a target; there are no phases to keep in step, so a plan is a function of the state.

The policy, as measured on the CPU backend:
- Decode runs every step for every request past its prefill: a running request never waits.
- One prefill group at a time. A group's prompts go through one forward pass together (far
  cheaper than one by one), so new requests are admitted only once the last group is done;
  a group is as many waiting requests, in arrival order, as fit the free rows,
  `prefill_batch_size` and `prefill_step_size` uncached prompt tokens. A first prompt longer
  than that goes alone and is prefilled in `prefill_step_size` chunks, one per step, so a
  long prompt stalls the decoders by one chunk at a time, never by its whole prefill.
- FIFO: a request never overtakes an earlier one that does not fit yet (the caller orders
  the queue, priorities included).
- A request whose prefill ends this step decodes the very next step: with
  `sample_in_prefill` (the model projects only the last positions) its last chunk takes the
  prompt's last token along and samples the first token; otherwise the prefill stops one
  token short and the next decode step feeds that token and samples the first token.
- Requests admitted this step do not decode in it; cancelled requests are simply absent from
  the caller's lists, which frees their rows and budget for the same step.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Budget:
    max_batch_size: int  # running requests at most
    prefill_batch_size: int  # requests admitted into one prefill group at most
    prefill_step_size: int  # prompt tokens prefilled per step at most
    max_queue: int  # waiting requests kept after admission; newer ones are turned away
    # The prefill's last chunk takes the prompt's last token and samples the first token.
    sample_in_prefill: bool = False


@dataclass(frozen=True)
class Waiting:
    id: int
    prompt_tokens: int
    cached_tokens: int = 0  # a prefix-cache hit: these need no prefill


@dataclass(frozen=True)
class Running:
    id: int
    prompt_tokens: int
    computed_tokens: int  # prompt tokens in its KV cache (cached ones included)


@dataclass(frozen=True)
class Chunk:
    """Prefill `length` prompt tokens of request `id`, from prompt position `start`."""

    id: int
    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class StepPlan:
    admitted: tuple[int, ...] = ()  # leave the queue and start (in this order)
    prefill: tuple[Chunk, ...] = ()
    decode: tuple[int, ...] = ()  # running requests past their prefill
    rejected: tuple[int, ...] = ()  # waiting past `max_queue`: turned away

    @property
    def idle(self) -> bool:
        return not (self.admitted or self.prefill or self.decode or self.rejected)

    @property
    def prefill_tokens(self) -> int:
        return sum(chunk.length for chunk in self.prefill)


def schedule(waiting: list[Waiting], running: list[Running], budget: Budget) -> StepPlan:
    """The next step for `waiting` (queue order) and `running` (admission order)."""
    decode: list[int] = []
    prefill: list[Chunk] = []
    room = budget.prefill_step_size
    for request in running:
        target = prefill_target(request.prompt_tokens, budget)
        if request.computed_tokens >= target:
            decode.append(request.id)
            continue
        length = min(target - request.computed_tokens, room)
        if length > 0:
            prefill.append(Chunk(request.id, request.computed_tokens, length))
            room -= length

    admitted: list[int] = []
    prefilling = any(r.computed_tokens < prefill_target(r.prompt_tokens, budget) for r in running)
    if not prefilling:
        slots = max(budget.max_batch_size - len(running), 0)
        for candidate in waiting[: min(slots, budget.prefill_batch_size)]:
            # The engine computes the last prompt token at least, whatever the cache holds.
            start = min(candidate.cached_tokens, candidate.prompt_tokens - 1)
            need = max(prefill_target(candidate.prompt_tokens, budget) - start, 0)
            if admitted and need > room:
                break  # FIFO: it waits for the next group rather than be overtaken
            admitted.append(candidate.id)
            length = min(need, room)
            if length > 0:
                prefill.append(Chunk(candidate.id, start, length))
                room -= length

    queued = waiting[len(admitted) :]
    rejected = tuple(w.id for w in queued[budget.max_queue :])
    return StepPlan(tuple(admitted), tuple(prefill), tuple(decode), rejected)


def prefill_target(prompt_tokens: int, budget: Budget) -> int:
    """Prompt tokens a request's prefill computes: all of them where the prefill samples the
    first token, else all but the last (fed by its first decode step)."""
    return prompt_tokens if budget.sample_in_prefill else max(prompt_tokens - 1, 0)
