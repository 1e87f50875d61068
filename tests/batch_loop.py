"""`schedule()` and `BatchExecutor` driven as `LLMCore.step` drives them, minus the text: for
tests that compare the executor's tokens with mlx-lm's `BatchGenerator`, call for call."""

from __future__ import annotations

import itertools
from typing import Any

from mlxd.executor.batch import BatchExecutor, NewRow
from mlxd.executor.decode_batch import TokenOut
from mlxd.executor.speculative import Speculator
from mlxd.scheduler import Budget, Running, Waiting, schedule


class BatchLoop:
    def __init__(
        self,
        model: Any,
        *,
        stop_tokens: list[int],
        speculator: Speculator[Any] | None = None,
        max_batch_size: int = 32,
        prefill_batch_size: int = 8,
        prefill_step_size: int = 2048,
    ):
        self.executor = BatchExecutor(model, stop_tokens=stop_tokens, speculator=speculator)
        self.budget = Budget(
            max_batch_size,
            prefill_batch_size,
            prefill_step_size,
            max_queue=1 << 30,
            sample_in_prefill=self.executor.samples_in_prefill,
        )
        self._uids = itertools.count()
        self._waiting: list[NewRow] = []
        self._running: dict[int, Running] = {}

    def insert(
        self,
        prompts: list[list[int]],
        max_tokens: list[int] | None = None,
        samplers: list[Any] | None = None,
        logits_processors: list[list[Any]] | None = None,
    ) -> list[int]:
        """Queue prompts as mlx-lm's `BatchGenerator.insert` does; their uids."""
        rows = [
            NewRow(
                next(self._uids),
                prompt,
                max_tokens[i] if max_tokens else 128,
                sampler=samplers[i] if samplers else None,
                logits_processors=logits_processors[i] if logits_processors else [],
            )
            for i, prompt in enumerate(prompts)
        ]
        self._waiting += rows
        return [row.uid for row in rows]

    def step(self) -> list[TokenOut]:
        waiting = [Waiting(row.uid, len(row.tokens)) for row in self._waiting]
        plan = schedule(waiting, list(self._running.values()), self.budget)
        admitted = self._waiting[: len(plan.admitted)]
        del self._waiting[: len(plan.admitted)]
        self.executor.add(admitted)
        self._running.update({row.uid: Running(row.uid, len(row.tokens), 0) for row in admitted})
        responses = self.executor.run(plan.prefill, plan.decode)
        for chunk in plan.prefill:
            request = self._running[chunk.id]
            self._running[chunk.id] = Running(request.id, request.prompt_tokens, chunk.end)
        for response in responses:
            if response.finish_reason is not None:
                del self._running[response.uid]
        return responses

    def next_generated(self) -> list[TokenOut]:
        """Steps until one produces tokens; [] once nothing is left to run."""
        while self._waiting or self._running:
            responses = self.step()
            if responses:
                return responses
        return []
