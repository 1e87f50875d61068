"""Runs a `scheduler.StepPlan`: prefill chunks, the decode step, first tokens, row removal.

The executor decides nothing: rows enter when the caller admits them (`add`), each step
prefills exactly the planned chunks and decodes the rows past their prefill, and rows leave
when they finish or the caller removes them. Rows live in two batches: prompts still being
prefilled in a `PromptBatch`, decoding rows in one `DecodeBatch` (prompt_batch.py,
decode_batch.py: what they do differently from mlx-lm's batches is said there).

Order within a step, each to shorten a first token's wait:
1. rows the plan decodes that finished their prefill one token short join the decode batch,
   so the decode step below feeds that token and samples their first token;
2. one decode step for every decoding row;
3. the prefill chunks that stop short of a prompt's end;
4. the chunks that end a prompt, its last token included (the model projects only last
   positions: `SkipPrefillLogits.projects_last`): the first tokens are sampled from that
   pass and handed out now, and the rows decode from the next step on.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlxd.executor.decode_batch import DecodeBatch, TokenOut
from mlxd.executor.prompt_batch import PromptBatch
from mlxd.executor.rows import Row, merge_caches
from mlxd.executor.sampling import GREEDY
from mlxd.executor.speculative import Speculator
from mlxd.scheduler import Chunk

# mlx-lm's BatchGenerator frees MLX's buffer cache this often (in decode steps).
_CLEAR_CACHE_EVERY = 512


@dataclass
class NewRow:
    """A request the caller admits. `tokens` are the prompt tokens its `cache` lacks, from
    prompt position `offset` on (a prefix-cache hit or a media prefill holds the others);
    `held`: the tokens the cache holds, as context for logits processors and drafts."""

    uid: int
    tokens: list[int]
    max_tokens: int
    offset: int = 0
    cache: list[Any] | None = None
    held: list[int] = field(default_factory=list)
    sampler: Any = None  # None: greedy
    logits_processors: list[Any] = field(default_factory=list)


@dataclass
class _Prefill:
    tokens: list[int]  # NewRow.tokens
    offset: int
    fed: int = 0  # of `tokens`, in the KV cache now

    def upto(self, end: int) -> list[int]:
        """The tokens still to feed to hold the prompt up to position `end`."""
        return self.tokens[self.fed : max(end - self.offset, self.fed)]

    @property
    def rest(self) -> list[int]:
        return self.tokens[self.fed :]


class BatchExecutor:
    def __init__(
        self,
        model: Any,
        *,
        stop_tokens: Collection[int],
        stream: mx.Stream | None = None,
        speculator: Speculator[Any] | None = None,
    ):
        """`model`: an mlx-lm model (or `SkipPrefillLogits` around one); `stop_tokens`: the
        tokens that end every row (the model's end-of-sequence tokens)."""
        self.model = model
        self.stream = stream or mx.new_stream(mx.default_device())
        self._prompts = PromptBatch(model, [], [])
        self._prefill: dict[int, _Prefill] = {}  # by uid, for the rows of `_prompts`
        self._decoding = DecodeBatch(model, stop_tokens, speculator)
        if speculator is not None:  # it may outlive an executor whose uids it saw
            speculator.retain([])
        self._decode_steps = 0

    @property
    def samples_in_prefill(self) -> bool:
        """Whether a prompt's last chunk can take its last token and sample the first."""
        return bool(getattr(self.model, "projects_last", False))

    def __len__(self) -> int:
        return len(self._prompts) + len(self._decoding)

    def add(self, rows: list[NewRow]) -> None:
        if not rows:
            return
        for row in rows:
            if not row.tokens:
                raise ValueError(f"row {row.uid} has no prompt token left to feed")
            self._prefill[row.uid] = _Prefill(row.tokens, row.offset)
        batch_rows = [
            Row(
                row.uid,
                list(row.held),
                row.max_tokens,
                row.sampler or GREEDY,
                tuple(row.logits_processors),
            )
            for row in rows
        ]
        caches = [row.cache or make_prompt_cache(self.model) for row in rows]
        self._prompts.extend(PromptBatch(self.model, batch_rows, merge_caches(caches)))

    def run(self, prefill: Sequence[Chunk], decode: Sequence[int]) -> list[TokenOut]:
        """One step: the tokens it produced, in order, per row (a finished row is removed)."""
        with mx.stream(self.stream):
            self._join_decoding(set(decode))
            responses: list[TokenOut] = []
            if len(self._decoding):
                responses = self._decoding.next()
                self._decode_steps += 1
                if self._decode_steps % _CLEAR_CACHE_EVERY == 0:
                    mx.clear_cache()
            ends = {chunk.id: chunk.end for chunk in prefill}
            final = {
                uid
                for uid, end in ends.items()
                if end >= self._prefill[uid].offset + len(self._prefill[uid].tokens)
            }
            self._feed({uid: end for uid, end in ends.items() if uid not in final})
            if final:
                responses += self._finish(final)
        return responses

    def remove(self, uids: list[int]) -> None:
        gone = set(uids)
        if gone & set(self._prompts.uids):
            self._prompts.filter([i for i, uid in enumerate(self._prompts.uids) if uid not in gone])
            for uid in gone & self._prefill.keys():
                del self._prefill[uid]
        if gone & set(self._decoding.uids):
            self._decoding.filter(
                [i for i, uid in enumerate(self._decoding.uids) if uid not in gone]
            )

    def extract_cache(self, uid: int) -> list[Any]:
        """A row's per-layer KV cache as it is now."""
        if uid in self._decoding.uids:
            return self._decoding.extract_cache(self._decoding.uids.index(uid))
        return self._prompts.extract_cache(self._prompts.uids.index(uid))

    def _join_decoding(self, decode: set[int]) -> None:
        """Rows whose prefill stopped one token short and that decode now: into the decode
        batch, which feeds their last prompt token."""
        joining = [i for i, uid in enumerate(self._prompts.uids) if uid in decode]
        if not joining:
            return
        batch = self._prompts.split(joining)
        rests = [self._prefill.pop(uid).rest for uid in batch.uids]
        if any(len(rest) > 1 for rest in rests):
            batch.prompt([rest[:-1] for rest in rests])
        self._decoding.join(batch.rows, batch.cache, [rest[-1] for rest in rests])

    def _feed(self, ends: dict[int, int]) -> None:
        """Prefill rows up to their planned ends, short of their prompts' ends."""
        tokens = {uid: self._prefill[uid].upto(end) for uid, end in ends.items()}
        tokens = {uid: fed for uid, fed in tokens.items() if fed}
        if not tokens:
            return
        uids = self._prompts.uids
        if tokens.keys() == set(uids):
            self._prompts.prompt([tokens[uid] for uid in uids])
        else:  # some rows sit this step out: prefill the others apart (copies their KV)
            rows = [i for i, uid in enumerate(uids) if uid in tokens]
            batch = self._prompts.split(rows)
            batch.prompt([tokens[uid] for uid in batch.uids])
            self._prompts.extend(batch)
        for uid, fed in tokens.items():
            self._prefill[uid].fed += len(fed)

    def _finish(self, final: set[int]) -> list[TokenOut]:
        """Prefill the rows whose prompts end this step, their last tokens included, and hand
        out their first tokens; the rows that go on decode from the next step."""
        if not self.samples_in_prefill:
            raise ValueError("this model cannot sample a first token from its prefill")
        rows = [i for i, uid in enumerate(self._prompts.uids) if uid in final]
        batch = self._prompts.split(rows)
        rests = [self._prefill.pop(uid).rest for uid in batch.uids]
        logits = batch.last_logits(rests)
        return self._decoding.join_sampled(
            batch.rows, batch.cache, [rest[-1] for rest in rests], logits
        )
