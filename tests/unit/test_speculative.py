"""Speculative decoding in the batch: prompt-lookup drafts, greedy output token for token the
plain decoder's (SmolLM2, mixed rows), stops inside accepted runs, and the sampled
distribution unchanged at temperature > 0 (chi-square on a tiny random model, fixed seeds)."""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.models.cache import BatchKVCache
from mlx_lm.sample_utils import make_logits_processors

from mlxd.config import BatchConfig, SpeculativeConfig, parse_config
from mlxd.errors import ModelLoadError
from mlxd.executor.prefill import SkipPrefillLogits
from mlxd.executor.sampling import GREEDY, make_sequence_sampler
from mlxd.executor.speculative import (
    DraftSpeculator,
    NgramSpeculator,
    ngram_drafts,
    roll_back,
)
from mlxd.types import Delta, Finished, GenerationRequest, SamplingParams
from mlxd.worker.llm_core import LLMCore
from mlxd.worker.llm_load import load_draft
from mlxd.worker.sequence import Sequence
from tests.batch_loop import BatchLoop
from tests.tiny_llama import tiny_llama
from tests.unit.test_core import LetterTokenizer, run

DOCUMENT = "The quick brown fox jumpd over the lazy dog. It was a sunny day."


def speculator(num_tokens: int = 4) -> NgramSpeculator:
    return NgramSpeculator(SpeculativeConfig(num_tokens=num_tokens, disable_by_batch_size=64))


def test_drafts_follow_the_latest_earlier_occurrence_of_the_longest_suffix() -> None:
    # "1 2 3" occurred twice before: the latest occurrence wins.
    assert ngram_drafts([1, 2, 3, 4, 1, 2, 3, 5, 6, 1, 2, 3], 2) == [5, 6]
    # No 3-gram or 2-gram match: the last token alone.
    assert ngram_drafts([7, 8, 9, 4, 9], 3) == [4, 9]
    # The continuation may run into the suffix itself; never past the end.
    assert ngram_drafts([5, 5, 5], 4) == [5]
    assert ngram_drafts([1, 2, 3], 4) == []
    assert ngram_drafts([1, 2, 1, 2], 0) == []


def test_a_row_drafts_one_more_token_than_it_accepted_last_time() -> None:
    spec = speculator(num_tokens=4)
    copying, single = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3], [9, 8, 9]
    assert spec.propose(7, copying, limit=10) == [4, 5, 6, 7]
    spec.record(7, drafted=4, accepted=0)
    # After a miss: one draft, and only from a match of the longest suffix.
    assert spec.propose(7, copying, limit=10) == [4]
    assert spec.propose(7, single, limit=10) == []
    assert spec.propose(8, single, limit=2) == [8, 9]  # other rows keep their own state
    spec.record(7, drafted=1, accepted=1)
    assert spec.propose(7, copying, limit=10) == [4, 5]
    assert spec.propose(7, single, limit=10) == [8, 9]
    spec.retain([8])  # row 7 left the batch: a new row 7 starts afresh
    assert spec.propose(7, copying, limit=10) == [4, 5, 6, 7]
    assert spec.counters.as_dict() == {
        "draft_tokens": 5,
        "accepted_tokens": 1,
        "acceptance_rate": 0.2,
    }


def test_roll_back_drops_each_rows_own_tail_and_its_positions() -> None:
    cache = BatchKVCache(left_padding=[1, 0])
    # Position p of row r holds the value 10 * r + p (row 0's first slot is padding).
    values = mx.array([[10 * r + p for p in range(5)] for r in range(2)], dtype=mx.float32)
    keys = values[:, None, :, None]
    cache.update_and_fetch(keys, keys)
    roll_back([cache], [3, 1])  # row 0 keeps p 1 of its p 1-4, row 1 keeps p 0-3
    assert cache.offset.tolist() == [1, 4]
    assert [cache.extract(r).keys[0, 0, :, 0].tolist() for r in range(2)] == [
        [1.0],
        [10.0, 11.0, 12.0, 13.0],
    ]
    # The next write lands right after each row's kept positions, at its own RoPE offset.
    cache.update_and_fetch(mx.full((2, 1, 1, 1), 99.0), mx.full((2, 1, 1, 1), 99.0))
    assert cache.offset.tolist() == [2, 5]
    assert cache.extract(0).keys[0, 0, :, 0].tolist() == [1.0, 99.0]
    assert cache.extract(1).keys[0, 0, :, 0].tolist() == [10.0, 11.0, 12.0, 13.0, 99.0]


def _generate(model: Any, prompts: list[list[int]], spec: NgramSpeculator | None, **rows: Any):
    generator = BatchLoop(SkipPrefillLogits(model), stop_tokens=rows.pop("eos"), speculator=spec)
    uids = generator.insert(prompts, **rows)
    tokens: dict[int, list[int]] = {uid: [] for uid in uids}
    finish: dict[int, str | None] = {}
    while responses := generator.next_generated():
        for response in responses:
            tokens[response.uid].append(response.token)
            if response.finish_reason:
                finish[response.uid] = response.finish_reason
    return [(tokens[u], finish.get(u)) for u in uids]


SmolRows = tuple[list[list[int]], dict[str, Any], list[Any]]


@pytest.fixture(scope="module")
def smol_rows(smol) -> SmolRows:
    """Prompts, their rows' settings, and their plain greedy completions."""
    tokenizer = smol.tokenizer
    # Plain completions (no chat template): short prompts keep the reference-BLAS prefill cheap.
    texts = [
        f"Original: {DOCUMENT}\nWith the spelling fixed: The",
        "A bicycle works like this:",
        "Three uses for a paperclip:",
    ]
    rows = {
        "eos": sorted(tokenizer.eos_token_ids),
        "max_tokens": [24, 10, 10],
        "samplers": [GREEDY] * 3,
        # The last row has a logits processor, so it never drafts: it decodes one token per
        # step inside the speculative forward of the others.
        "logits_processors": [[], [], make_logits_processors(repetition_penalty=1.3)],
    }
    prompts = [tokenizer.encode(t) for t in texts]
    return prompts, rows, _generate(smol.model, prompts, None, **rows)


def test_greedy_speculation_gives_the_plain_tokens_on_smollm2(smol, smol_rows) -> None:
    tokenizer = smol.tokenizer
    prompts, rows, plain = smol_rows
    spec = speculator()
    assert _generate(smol.model, prompts, spec, **rows) == plain
    edited = tokenizer.decode(plain[0][0])
    assert "quick brown fox jumped over" in edited  # the editing row copies the document
    assert plain[1][1] == "length"
    # The copied document is drafted and accepted; the short rows have drafts too.
    assert spec.counters.accepted_tokens >= 5
    assert spec.counters.draft_tokens > spec.counters.accepted_tokens


DRAFTING = SpeculativeConfig(mode="draft", model="draft", num_tokens=4, disable_by_batch_size=8)


def test_a_draft_model_gives_the_plain_tokens_on_smollm2(smol, smol_rows) -> None:
    """SmolLM2 drafting for itself has every draft accepted (so its per-row caches follow
    the rows exactly); a random draft with SmolLM2's vocabulary changes no token either."""
    prompts, rows, plain = smol_rows
    itself = DraftSpeculator(DRAFTING, smol.model)
    assert _generate(smol.model, prompts, itself, **rows) == plain
    assert itself.counters.draft_tokens >= 20
    assert itself.counters.as_dict()["acceptance_rate"] == 1.0
    assert not itself._rows  # each row's draft cache went when the row finished
    noise = DraftSpeculator(DRAFTING, tiny_llama(smol.config["vocab_size"], seed=5))
    assert _generate(smol.model, prompts, noise, **rows) == plain
    assert noise.counters.draft_tokens > noise.counters.accepted_tokens


def test_the_draft_cache_keeps_exactly_the_tokens_the_target_kept(tiny) -> None:
    """After any verification the next drafts are those of a fresh draft cache fed the row's
    tokens: the rejected drafts were trimmed, the kept ones not fed twice."""
    for accepted in (0, 2, 3):
        spec = DraftSpeculator(DRAFTING.model_copy(update={"num_tokens": 3}), tiny)
        tokens = [1, 2, 3, 4, 5, 1, 2]
        drafts = spec.propose(0, tokens, limit=10)
        assert len(drafts) == 3
        spec.record(0, drafted=3, accepted=accepted)
        # The kept drafts, then the target's own token (the row's next pending token).
        tokens += [*drafts[:accepted], (drafts[accepted] + 1) % 8 if accepted < 3 else 6]
        expected = DraftSpeculator(spec.config, tiny).propose(0, tokens, limit=10)
        assert spec.propose(0, tokens, limit=10) == expected
        assert spec._rows[0].cache[0].offset == len(tokens) + 2
    assert spec.propose(1, tokens, limit=1) == expected[:1]
    assert spec.propose(2, tokens, limit=0) == []


def test_a_new_generator_starts_its_speculator_afresh(tiny) -> None:
    """A generator rebuilt after a failed step numbers its rows from 0 again: the draft cache
    of the old generator's row 0 (never filtered out) must not be taken for the new row 0."""
    prompt = [[1, 2, 3, 4, 1, 2]]
    rows = {"eos": [], "max_tokens": [6], "samplers": [GREEDY]}
    plain = _generate(tiny, prompt, None, **rows)
    spec = DraftSpeculator(DRAFTING, tiny)
    spec.propose(0, list(range(8)) * 4, limit=4)
    assert _generate(tiny, prompt, spec, **rows) == plain
    assert spec.counters.as_dict()["acceptance_rate"] == 1.0


def test_a_draft_with_another_vocabulary_is_refused_at_load(smol, tmp_path: Path) -> None:
    # A tiny llama on disk with SmolLM2's tokenizer files but a 64-token embedding.
    model = tiny_llama(vocab_size=64, seed=1)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol.path / name, tmp_path / name)
    args = {key: value for key, value in vars(model.args).items() if value is not None}
    (tmp_path / "config.json").write_text(json.dumps(args))
    config = parse_config(
        f"models:\n  small: {{source: {tmp_path}}}\n  smol:\n    source: {smol.path}\n"
        "    speculative: {mode: draft, model: small}\n",
        filename="models.yaml",
        env={},
    )
    speculative = config.models["smol"].speculative
    assert speculative is not None
    with pytest.raises(
        ModelLoadError, match="'small' has a vocabulary of 64 tokens, this model 49152"
    ):
        load_draft("smol", speculative, smol, tmp_path)


@pytest.fixture(scope="module")
def tiny() -> llama.Model:
    return tiny_llama(vocab_size=8, seed=3)


def test_a_stop_inside_an_accepted_run_ends_where_plain_decoding_does(tiny) -> None:
    """Through the core: detokenizer, stop strings and max_tokens see accepted tokens one by
    one, so every event is the plain decoder's."""
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 6, 5, 6, 5], [3, 1, 4, 1, 5, 1, 3]]
    greedy = SamplingParams(temperature=0.0)

    def events(spec: SpeculativeConfig | None, stop: list[str], max_tokens: int) -> list:
        core = LLMCore("tiny", tiny, LetterTokenizer(), BatchConfig(), spec)
        core.start()
        sequences = [
            Sequence(GenerationRequest("r", "tiny", max_tokens, greedy, stop=stop), p)
            for p in prompts
        ]
        for s in sequences:
            core.add(s)
        outputs = run(core)
        accepted = core.speculator.counters.accepted_tokens if core.speculator else 0
        return [[e for s2, e in outputs if s2 is s] for s in sequences], accepted

    config = SpeculativeConfig(num_tokens=4, disable_by_batch_size=8)
    plain_tokens, _ = events(None, [], 24)
    texts = ["".join(e.text for e in ev if isinstance(e, Delta)) for ev in plain_tokens]
    # Stops that end each sequence a few tokens in, i.e. inside a run of accepted drafts.
    stops = [text[5:7] for text in texts]
    for stop, max_tokens in (([], 24), ([], 7), (stops, 24)):
        plain, _ = events(None, stop, max_tokens)
        spec, accepted = events(config, stop, max_tokens)
        assert spec == plain
        assert accepted > 0
    assert any(isinstance(e, Finished) and e.reason == "stop" for ev in plain for e in ev)


def _chi_square_exceeds(a: Counter, b: Counter) -> tuple[float, float]:
    """Two-sample chi-square statistic over cells seen at least 10 times in total, and its
    0.1% critical value (Wilson-Hilferty)."""
    cells = [c for c in a.keys() | b.keys() if a[c] + b[c] >= 10]
    na, nb = sum(a[c] for c in cells), sum(b[c] for c in cells)
    stat = 0.0
    for cell in cells:
        total = a[cell] + b[cell]
        for count, n in ((a[cell], na), (b[cell], nb)):
            expected = total * n / (na + nb)
            stat += (count - expected) ** 2 / expected
    k = len(cells) - 1
    critical = k * (1 - 2 / (9 * k) + 3.09 * math.sqrt(2 / (9 * k))) ** 3
    return stat, critical


def test_sampling_keeps_the_distribution_at_temperature_above_zero(tiny) -> None:
    """Many continuations of one prompt with and without speculation: the per-position token
    counts and the joint counts of (2nd, 3rd) token agree (fixed seeds: deterministic)."""
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    count, length = 1500, 5
    sampler = make_sequence_sampler(SamplingParams(temperature=0.7), 8)

    def sample(spec: NgramSpeculator | None) -> list[tuple[int, ...]]:
        mx.random.seed(11)
        generator = BatchLoop(
            tiny,
            stop_tokens=[],
            speculator=spec,
            max_batch_size=count,
            prefill_batch_size=count,
            prefill_step_size=count * len(prompt),  # every row in one batch, as mlx-lm does
        )
        uids = generator.insert(
            [prompt] * count, max_tokens=[length] * count, samplers=[sampler] * count
        )
        tokens: dict[int, list[int]] = {uid: [] for uid in uids}
        while responses := generator.next_generated():
            for response in responses:
                tokens[response.uid].append(response.token)
        return [tuple(tokens[u]) for u in uids]

    spec = NgramSpeculator(SpeculativeConfig(num_tokens=3, disable_by_batch_size=count))
    plain, drafted = sample(None), sample(spec)
    assert all(len(t) == length for t in plain + drafted)
    # Drafts were both accepted and rejected often: the rule was exercised both ways.
    counters = spec.counters
    assert counters.accepted_tokens > 500
    assert counters.draft_tokens - counters.accepted_tokens > 500
    for position in range(1, length):
        stat, critical = _chi_square_exceeds(
            Counter(t[position] for t in plain), Counter(t[position] for t in drafted)
        )
        assert stat < critical, (position, stat, critical)
    stat, critical = _chi_square_exceeds(
        Counter(t[1:3] for t in plain), Counter(t[1:3] for t in drafted)
    )
    assert stat < critical, (stat, critical)
