"""The decode step's deferred top-p fallback: a row whose nucleus reaches past its candidates
is drawn again from the full sort before its token is fed to the next step or handed out."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_top_p

from mlxd.executor.nucleus import CANDIDATES
from mlxd.executor.sampling import GREEDY, make_sequence_sampler
from mlxd.types import SamplingParams
from tests.batch_loop import BatchLoop
from tests.tiny_llama import tiny_llama

VOCAB, TOKENS, SEED = 4096, 12, 3
SEEDED = SamplingParams(temperature=0.7, top_p=0.9, seed=SEED)


def _generate(model, prompts: list[list[int]], samplers: list) -> list[list[int]]:
    loop = BatchLoop(model, stop_tokens=[])
    uids = loop.insert(prompts, max_tokens=[TOKENS] * len(prompts), samplers=samplers)
    out: dict[int, list[int]] = {uid: [] for uid in uids}
    while responses := loop.next_generated():
        for response in responses:
            out[response.uid].append(response.token)
    return [out[uid] for uid in uids]


class FullSortReference:
    """mlx-lm's top-p rule with the seeded row's key sequence: what the row must draw when
    every step falls back; also checks that every step did (a nucleus past the candidates)."""

    def __init__(self) -> None:
        self.key = mx.random.key(SEED)

    def __call__(self, logprobs: mx.array) -> mx.array:
        self.key, step_key = mx.random.split(self.key)
        masked = apply_top_p(logprobs, 0.9)
        assert (np.asarray(masked) > -np.inf).sum() > CANDIDATES
        # One row, drawn as the batched draw draws each row: over its own vector.
        return mx.random.categorical(masked[0] * (1.0 / 0.7), key=step_key)[None]


def test_a_row_past_its_candidates_feeds_the_full_sort_token_in_a_pipelined_batch():
    # A random model's distributions are flat: every step of the seeded row falls back.
    model = tiny_llama(vocab_size=VOCAB, seed=2)
    prompt = [5, 17, 300, 2000, 9]
    reference = _generate(model, [prompt], [FullSortReference()])[0]
    unseeded = make_sequence_sampler(SamplingParams(temperature=0.7, top_p=0.9), VOCAB)
    seeded = make_sequence_sampler(SEEDED, VOCAB)
    rows = _generate(model, [[8, 9, 10], prompt, [4000, 3]], [GREEDY, seeded, unseeded])
    assert len(reference) == TOKENS
    assert rows[1] == reference
    assert all(len(tokens) == TOKENS for tokens in rows)
