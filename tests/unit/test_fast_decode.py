"""The fast decode path changes no greedy token: rational SiLU + logprob-skipping batch step
against mlx-lm's exact SiLU and stock BatchGenerator, on SmolLM2 with real prompts."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_unflatten
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.activations import swiglu
from mlx_lm.models.cache import BatchKVCache
from mlx_lm.sample_utils import make_logits_processors

from mlxd.executor.prefill import SkipPrefillLogits
from mlxd.executor.rows import finalize_used_span
from mlxd.executor.sampling import (
    GREEDY,
    GREEDY_WITH_LOGPROBS,
    make_sequence_sampler,
    sample_rows,
)
from mlxd.models.activations import RationalSwiGLU, use_rational_swiglu
from mlxd.types import SamplingParams
from tests.batch_loop import BatchLoop

PROMPTS = [
    "Write a short story about a brave fox on a train.",
    "Explain how a bicycle works to a child.",
    "List five uses for a paperclip and say why each works.",
    "What is the capital of France? Tell me about its history.",
]
TOKENS = 64


def test_greedy_rows_skip_logprobs_and_keep_the_argmax() -> None:
    logits = mx.random.normal((4, 50)) * 5
    sampled, logprobs = sample_rows(logits, [GREEDY] * 4)
    assert sampled.tolist() == mx.argmax(logits, axis=-1).tolist()
    assert logprobs == [None] * 4


def test_mixed_samplers_keep_batch_order_and_normalise_only_asking_rows() -> None:
    logits = mx.random.normal((5, 50)) * 5
    samplers = [GREEDY, GREEDY_WITH_LOGPROBS, GREEDY, GREEDY_WITH_LOGPROBS, GREEDY]
    sampled, logprobs = sample_rows(logits, samplers)
    assert sampled.tolist() == mx.argmax(logits, axis=-1).tolist()
    assert [lp is None for lp in logprobs] == [True, False, True, False, True]
    expected = logits[1] - mx.logsumexp(logits[1])
    assert mx.allclose(logprobs[1], expected).item()


def test_greedy_sampler_choice_follows_top_logprobs() -> None:
    assert make_sequence_sampler(SamplingParams(temperature=0), 100) is GREEDY
    asking = SamplingParams(temperature=0, top_logprobs=0)
    assert make_sequence_sampler(asking, 100) is GREEDY_WITH_LOGPROBS


def _generate(
    generator: BatchGenerator | BatchLoop, prompts: list[list[int]], samplers: list
) -> dict:
    uids = generator.insert(prompts, max_tokens=[TOKENS] * len(prompts), samplers=samplers)
    tokens: dict[int, list[int]] = {uid: [] for uid in uids}
    logprobs: dict[int, list] = {uid: [] for uid in uids}
    while True:
        responses = generator.next_generated()
        if not responses:
            break
        for response in responses:
            tokens[response.uid].append(response.token)
            logprobs[response.uid].append(response.logprobs)
    return {"tokens": [tokens[u] for u in uids], "logprobs": [logprobs[u] for u in uids]}


class ExactSwiGLU(nn.Module):
    """mlx-lm's SwiGLU MLP forward (exact SiLU) over a RationalSwiGLU's projections."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def _set_exact_silu(model, exact: bool) -> None:
    swaps = [(n, ExactSwiGLU(m)) for n, m in model.named_modules() if isinstance(m, RationalSwiGLU)]
    if exact and swaps:
        model.update_modules(tree_unflatten(swaps))
    if not exact:
        use_rational_swiglu(model)


def test_fast_path_gives_the_same_greedy_tokens_on_smollm2(smol) -> None:
    tokenizer = smol.tokenizer
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True
        )
        for p in PROMPTS
    ]
    eos = [[t] for t in sorted(tokenizer.eos_token_ids)]
    # Reference: exact SiLU, mlx-lm's own batch step (logsumexp every row).
    _set_exact_silu(smol.model, exact=True)
    reference = _generate(
        BatchGenerator(smol.model, stop_tokens=eos), prompts, [GREEDY_WITH_LOGPROBS] * 4
    )
    # Fast: rational SiLU, logprobs only for the second prompt.
    assert use_rational_swiglu(smol.model) == len(smol.model.model.layers)
    samplers = [GREEDY, GREEDY_WITH_LOGPROBS, GREEDY, GREEDY]
    fast = _generate(
        BatchLoop(smol.model, stop_tokens=sorted(tokenizer.eos_token_ids)), prompts, samplers
    )

    assert fast["tokens"] == reference["tokens"]
    assert sum(len(t) for t in fast["tokens"]) > 2 * TOKENS  # the prompts did generate
    assert all(lp is None for lp in fast["logprobs"][0])
    for ours, theirs in zip(fast["logprobs"][1], reference["logprobs"][1], strict=True):
        # Top log-probabilities barely move with the rational SiLU.
        assert abs(ours.max().item() - theirs.max().item()) < 1e-3


def test_a_first_token_goes_out_with_the_step_that_computes_it(smol) -> None:
    """mlx-lm hands a step's tokens out once the next step has started, which on the CPU
    means once it has nearly run (MLX's async_eval waits until few ops are left): a first
    token came out a step late. When it arrives here, the model has run the prompt and one
    decode step; later tokens are pipelined, and every token is mlx-lm's."""
    forward_lengths: list[int] = []

    class Counting:
        layers = smol.model.layers

        def __call__(self, inputs: mx.array, cache=None) -> mx.array:
            forward_lengths.append(inputs.shape[1])
            return smol.model(inputs, cache=cache)

    prompt = smol.tokenizer.encode("The capital of France is")
    generator = BatchLoop(Counting(), stop_tokens=[])
    generator.insert([prompt], max_tokens=[6])
    first: list = []
    while not first:
        first = generator.next_generated()
    assert forward_lengths == [len(prompt) - 1, 1]  # the prompt, then one step

    tokens = [first[0].token]
    while responses := generator.next_generated():
        tokens += [r.token for r in responses]
    reference = BatchGenerator(smol.model, stop_tokens=[])
    reference.insert([prompt], max_tokens=[6])
    expected = []
    while responses := reference.next_generated():
        expected += [r.token for r in responses]
    assert tokens == expected


def test_a_prefilled_prompt_joins_the_very_next_decode_step(smol) -> None:
    """While another sequence decodes, a prompt whose prefill has just run gets its first
    token from the next step. mlx-lm moves it into the decode batch only after that step's
    decode, so the first token came one step of the whole batch later."""
    encode = smol.tokenizer.encode
    generator = BatchLoop(smol.model, stop_tokens=[])
    generator.insert([encode("Once upon a time")], max_tokens=[64])
    while not generator.next_generated():
        pass  # the first sequence is decoding
    (joining,) = generator.insert([encode("The capital of France is")], max_tokens=[4])
    steps, uids = 0, set()
    while joining not in uids:
        uids = {response.uid for response in generator.next_generated()}
        steps += 1
    assert steps == 2  # its prefill (with the other's decode), then the decode it joins


@pytest.mark.parametrize("weights", ["smol", "smol_packed"])
def test_first_tokens_from_the_prefill_of_the_last_prompt_tokens_are_mlx_lms(
    weights: str, request: pytest.FixtureRequest
) -> None:
    """Where the model projects last positions alone, a prompt's last token goes into its
    prefill and the first token is sampled from that pass: prompts of different lengths
    (right-padded, then rolled), one with a repetition penalty over its context, one
    asking for logprobs, one done at its first token. Every token is mlx-lm's."""
    loaded = request.getfixturevalue(weights)
    model = SkipPrefillLogits(loaded.model)
    assert model.projects_last
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS]
    penalty = make_logits_processors(repetition_penalty=1.5)
    options = {
        "max_tokens": [12, 12, 12, 1],
        "logits_processors": [[], penalty, [], []],
    }
    ours = BatchLoop(model, stop_tokens=[])
    reference = BatchGenerator(loaded.model, stop_tokens=[])
    ours_uids = ours.insert(
        prompts, samplers=[GREEDY, GREEDY, GREEDY_WITH_LOGPROBS, GREEDY], **options
    )
    theirs_uids = reference.insert(prompts, samplers=[GREEDY_WITH_LOGPROBS] * 4, **options)

    def run(generator: BatchGenerator | BatchLoop, uids: list[int]) -> list[list]:
        out: dict[int, list] = {uid: [] for uid in uids}
        while responses := generator.next_generated():
            for response in responses:
                out[response.uid].append((response.token, response.logprobs))
        return [out[uid] for uid in uids]

    got, expected = run(ours, ours_uids), run(reference, theirs_uids)
    assert [[t for t, _ in row] for row in got] == [[t for t, _ in row] for row in expected]
    assert [len(row) for row in got] == [12, 12, 12, 1]
    for (_, mine), (_, theirs) in zip(got[2], expected[2], strict=True):
        assert abs(mine.max().item() - theirs.max().item()) < 1e-3


def test_a_lone_prompt_gets_its_first_token_from_the_step_that_prefills_it(smol) -> None:
    """No decode step of its own for the prompt's last token: the generator's first step
    prefills the prompt and hands out its first token; one joining a decoding batch gets
    its first token from its prefill too, before it joins."""
    encode = smol.tokenizer.encode
    generator = BatchLoop(SkipPrefillLogits(smol.model), stop_tokens=[])
    (first,) = generator.insert([encode("Once upon a time")], max_tokens=[64])
    assert {response.uid for response in generator.next_generated()} == {first}
    (joining,) = generator.insert([encode("The capital of France is")], max_tokens=[4])
    uids = {response.uid for response in generator.next_generated()}
    assert uids == {first, joining}


def test_rolling_only_the_used_span_leaves_every_row_as_mlx_lm_does() -> None:
    """Prompts of 3, 1 and 2 new tokens after cached prefixes: right-padded, then rolled into
    left padding. Every position a row attends to matches mlx-lm's, before and after the
    next decode step grows the (now smaller) buffer."""
    ours, theirs = BatchKVCache([1, 0, 2]), BatchKVCache([1, 0, 2])
    prefix, prompt, step = (mx.random.normal((3, 2, n, 4)) for n in (5, 3, 1))
    for cache in (ours, theirs):
        cache.update_and_fetch(prefix, prefix + 1)
        cache.prepare(lengths=[3, 1, 2], right_padding=[0, 2, 1])
        cache.update_and_fetch(prompt, prompt + 1)
    finalize_used_span(ours)
    theirs.finalize()
    assert ours.keys.shape[2] == 8 < theirs.keys.shape[2]  # 8 in use of 256 allocated

    def attended(cache: BatchKVCache) -> list[mx.array]:
        keys, values = cache.keys_and_values()
        starts = cache.left_padding.tolist()
        return [kv[row, :, start:] for row, start in enumerate(starts) for kv in (keys, values)]

    assert (ours.offset.tolist(), ours.left_padding.tolist()) == ([7, 6, 5], [1, 2, 3])
    for _ in range(2):
        assert ours.offset.tolist() == theirs.offset.tolist()
        assert ours.left_padding.tolist() == theirs.left_padding.tolist()
        for a, b in zip(attended(ours), attended(theirs), strict=True):
            assert mx.array_equal(a, b)
        for cache in (ours, theirs):
            cache.update_and_fetch(step, step + 1)
