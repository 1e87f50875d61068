"""A seeded top-p row in the pipelined decode batch (a step's tokens fed to the next while the
previous ones are handed out) draws what its own key draws, whatever rows share its batch."""

from __future__ import annotations

import pytest

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


@pytest.mark.usefixtures("sampling_path")
def test_a_seeded_row_in_a_pipelined_batch_draws_what_it_draws_alone():
    # A random model's distributions are flat: each nucleus is most of the vocabulary.
    model = tiny_llama(vocab_size=VOCAB, seed=2)
    prompt = [5, 17, 300, 2000, 9]
    alone = _generate(model, [prompt], [make_sequence_sampler(SEEDED, VOCAB)])[0]
    unseeded = make_sequence_sampler(SamplingParams(temperature=0.7, top_p=0.9), VOCAB)
    seeded = make_sequence_sampler(SEEDED, VOCAB)
    rows = _generate(model, [[8, 9, 10], prompt, [4000, 3]], [GREEDY, seeded, unseeded])
    assert len(alone) == TOKENS
    assert rows[1] == alone
    assert all(len(tokens) == TOKENS for tokens in rows)
    assert len(set(alone)) > TOKENS // 2  # drawn, not the argmax every step
