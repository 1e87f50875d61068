"""The synchronous LLM core on a tiny random llama (real mlx-lm BatchGenerator), and the
ModelLoop that drives every core: statuses, events, aborts, faults, the crash guard."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from mlx_lm.models import llama
from mlx_lm.tokenizer_utils import NaiveStreamingDetokenizer

from mlxd.cache.lease import PrefixLease
from mlxd.cache.prefix import PrefixCache
from mlxd.config import BatchConfig, CacheConfig
from mlxd.errors import Overloaded, Unavailable
from mlxd.types import Delta, Finished, GenerationRequest, SamplingParams
from mlxd.worker import warm_up
from mlxd.worker.llm_core import LLMCore
from mlxd.worker.loop import ModelLoop
from mlxd.worker.sequence import CoreStats, Output, Sequence, SequenceStatus
from tests.tiny_llama import tiny_llama

S = SequenceStatus


class LetterTokenizer:
    """Token i is a letter; token 0 ends a sequence. Enough for the core's detokenizing."""

    eos_token_ids = (0,)

    def __len__(self) -> int:
        return 64

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [1 + (ord(c) % 26) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + (i - 1) % 26) for i in ids)

    @property
    def detokenizer(self) -> NaiveStreamingDetokenizer:
        return NaiveStreamingDetokenizer(self)


@pytest.fixture(scope="module")
def model() -> llama.Model:
    return tiny_llama()


def core_for(model: Any, **batch: int) -> LLMCore:
    core = LLMCore("tiny", model, LetterTokenizer(), BatchConfig(**batch))
    core.start()
    return core


def sequence(
    prompt: list[int], max_tokens: int = 6, priority: int = 0, processors: list | None = None
) -> Sequence:
    request = GenerationRequest(
        "r",
        "tiny",
        max_tokens,
        # Token 0 (end of sequence) banned: every sequence runs to max_tokens.
        sampling=SamplingParams(temperature=0.0, logit_bias={0: -1e9}),
        priority=priority,
    )
    return Sequence(request, prompt, processors=processors or [])


def run(core: LLMCore, limit: int = 100) -> list[Output]:
    outputs: list[Output] = []
    for _ in range(limit):
        if not core.has_work:
            break
        outputs.extend(core.step())
    return outputs


def tokens_of(outputs: list[Output], seq: Sequence) -> list[int]:
    return [t for s, e in outputs if s is seq and isinstance(e, Delta) for t in e.token_ids]


def test_a_sequence_goes_waiting_prefilling_decoding_finished(model):
    core = core_for(model)
    seq = sequence([5, 6, 7], max_tokens=4)
    core.add(seq)
    assert seq.status is S.WAITING and core.waiting == 1
    seen = []
    while core.has_work:
        core.step()
        seen.append(seq.status)
    assert seen[0] in (S.PREFILLING, S.DECODING)
    assert S.DECODING in seen and seen[-1] is S.FINISHED_LENGTH
    assert seq.status.finished and not S.DECODING.finished
    assert core.running == 0 and core.waiting == 0


def test_events_end_with_one_finished_counting_every_token(model):
    core = core_for(model)
    seq = sequence([5, 6, 7], max_tokens=5)
    core.add(seq)
    outputs = run(core)
    events = [e for s, e in outputs if s is seq]
    assert isinstance(events[-1], Finished)
    assert events[-1] == Finished("length", 3, 5)
    assert len(tokens_of(outputs, seq)) == 5
    assert sum(isinstance(e, Finished) for e in events) == 1


def test_batched_greedy_output_equals_each_sequence_alone(model):
    prompts = [[5, 6, 7], [9, 3], [12, 12, 12, 4]]
    alone = []
    for prompt in prompts:
        core = core_for(model)
        seq = sequence(prompt)
        core.add(seq)
        alone.append(tokens_of(run(core), seq))
    core = core_for(model)
    together = [sequence(p) for p in prompts]
    for seq in together:
        core.add(seq)
    outputs = run(core)
    assert [tokens_of(outputs, seq) for seq in together] == alone
    assert core.stats.multi_sequence_steps > 0


def test_prompt_blocks_are_kept_after_the_first_token_went_out(model, tmp_path):
    """Copying a new prompt's blocks into the prefix cache waits for the next step, so the
    first token does not wait for it; a later request with the same prompt hits them and
    answers the same."""
    prefix = PrefixCache({"model": "tiny"}, CacheConfig(block_size=4), tmp_path)
    prompt = list(range(1, 11))

    def leased(prompt: list[int]) -> Sequence:
        seq = sequence(prompt, max_tokens=3)
        seq.lease = PrefixLease(prefix, prompt, prefix.keys(prompt))
        return seq

    core = core_for(model)
    first = leased(prompt)
    core.add(first)
    outputs: list[Output] = []
    while not tokens_of(outputs, first):
        outputs += core.step()
    assert prefix.missing(first.lease.keys)  # not yet: the first token came first
    outputs += run(core)
    assert not prefix.missing(first.lease.keys)
    again = leased(prompt)
    core.add(again)
    assert tokens_of(run(core), again) == tokens_of(outputs, first)
    assert again.lease.match.tokens == 8  # two whole blocks; the last token is always fed


def test_a_sequence_aborted_at_its_first_token_still_leaves_its_prompt_cached(model, tmp_path):
    """A client that disconnects once it saw the first token (or a stop string in it) ends
    the sequence before the deferred store: its prompt is kept as it leaves."""
    prefix = PrefixCache({"model": "tiny"}, CacheConfig(block_size=4), tmp_path)
    prompt = list(range(1, 11))
    seq = sequence(prompt, max_tokens=50)
    seq.lease = PrefixLease(prefix, prompt, prefix.keys(prompt))
    core = core_for(model)
    core.add(seq)
    outputs: list[Output] = []
    while not tokens_of(outputs, seq):
        outputs += core.step()
    assert prefix.missing(seq.lease.keys)
    core.abort(seq)
    assert not prefix.missing(seq.lease.keys)
    assert not core.has_work


def test_abort_while_waiting_and_while_running(model):
    core = core_for(model, max_batch_size=1)
    running, waiting = sequence([5, 6], max_tokens=50), sequence([7, 8], max_tokens=50)
    core.add(running)
    core.add(waiting)
    for _ in range(10):
        if running.status is S.DECODING:
            break
        core.step()
    assert running.status is S.DECODING and waiting.status is S.WAITING
    aborted = core.abort(waiting) + core.abort(running)
    assert [e.reason for _, e in aborted] == ["cancelled", "cancelled"]
    assert running.status is S.FINISHED_ABORTED and waiting.status is S.FINISHED_ABORTED
    assert core.abort(running) == []  # aborting twice does nothing
    assert not core.has_work and core.stats.cancelled == 2


def test_interactive_requests_queue_ahead_of_batch_work(model):
    core = core_for(model, max_batch_size=1)
    first, batch, interactive = sequence([5]), sequence([6], priority=-1), sequence([7])
    for seq in (first, batch, interactive):
        core.add(seq)
    outputs = run(core)
    finished = [s for s, e in outputs if isinstance(e, Finished)]
    assert finished == [first, interactive, batch]


def test_a_failing_processor_fails_its_sequence_alone(model):
    def explode(tokens: Any, logits: Any) -> Any:
        raise RuntimeError("boom")

    core = core_for(model)
    bad, good = sequence([5, 6], processors=[explode]), sequence([7, 8])
    core.add(bad)
    core.add(good)
    outputs = run(core)
    ends = {s: e for s, e in outputs if isinstance(e, Finished)}
    assert ends[bad].reason == "error" and "boom" in ends[bad].error
    assert bad.status is S.FINISHED_ERROR
    assert ends[good].reason == "length" and good.status is S.FINISHED_LENGTH


def test_fail_all_ends_everything_with_the_message(model):
    core = core_for(model, max_batch_size=1)
    seqs = [sequence([5]), sequence([6])]
    for seq in seqs:
        core.add(seq)
    core.step()
    outputs = core.fail_all("gone")
    assert sorted(e.error for _, e in outputs) == ["gone", "gone"]
    assert all(s.status is S.FINISHED_ERROR for s in seqs) and not core.has_work


def test_warm_up_batch_sizes_and_prompt_lengths_are_powers_of_two_and_the_largest():
    assert warm_up.batch_sizes(1) == [1]
    assert warm_up.batch_sizes(6) == [1, 2, 4, 6]
    assert warm_up.batch_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert warm_up.prompt_lengths(256) == [8, 16, 32, 64, 128, 256]
    assert warm_up.prompt_lengths(40) == [8, 16, 32, 40]
    assert warm_up.prompt_lengths(5) == [5]


def test_a_warm_up_runs_each_batch_size_and_leaves_nothing_behind(model):
    batch = BatchConfig(max_batch_size=6, prefill_step_size=40)
    rounds = warm_up.rounds(LetterTokenizer(), batch, context_length=64, model="tiny")
    # One row at each prompt length, then each batch size greedy and at top-p.
    assert [len(r) for r in rounds] == [1, 1, 1, 1, 1, 1, 2, 2, 4, 4, 6, 6]
    assert [len(r[0].prompt) for r in rounds[:4]] == [8, 16, 32, 40]
    assert [len(row.prompt) for row in rounds[-1]] == [8, 16, 32, 40, 40, 8]
    assert {r[0].sampling.temperature for r in rounds[4:]} == {0.0, 0.7}
    assert [r.max_tokens for r in rounds[-1]] == [9] * 6  # 3 past the last row's admission
    warmed = LLMCore("tiny", model, LetterTokenizer(), batch, warm_up=lambda: rounds)
    warmed.start()
    rows = [rows for rows, _ in warmed.warm_up_rounds]
    assert rows == [1, 1, 1, 1, 1, 1, 2, 2, 4, 4, 6, 6]
    assert all(seconds > 0 for _, seconds in warmed.warm_up_rounds)
    assert not warmed.has_work and warmed.stats == CoreStats()
    # What it runs next is what a core that never warmed up runs.
    cold = core_for(model, max_batch_size=6, prefill_step_size=40)
    outputs = {}
    for core in (warmed, cold):
        seq = sequence([3, 1, 4, 1, 5], max_tokens=8)
        core.add(seq)
        outputs[core] = tokens_of(run(core), seq)
    assert outputs[warmed] == outputs[cold] and len(outputs[cold]) == 8
    assert warmed.stats.finished == 1 and warmed.stats.prompt_tokens == 5


def test_warm_up_rounds_keep_to_the_queue_and_the_context():
    batch = BatchConfig(max_batch_size=32, max_queue=6, prefill_step_size=256)
    rounds = warm_up.rounds(LetterTokenizer(), batch, context_length=40, model="tiny")
    assert max(len(r) for r in rounds) == 6  # more at once would be refused (429)
    assert all(len(q.prompt) + q.max_tokens <= 40 for r in rounds for q in r)


def test_a_warm_up_stopped_by_a_close_runs_no_further_round(model):
    rounds = warm_up.rounds(LetterTokenizer(), BatchConfig(max_batch_size=4), 64, "tiny")
    core = LLMCore(
        "tiny", model, LetterTokenizer(), BatchConfig(max_batch_size=4), warm_up=lambda: rounds
    )
    core.stop_warm_up()
    core.start()
    assert core.warm_up_rounds == [] and not core.has_work


class TwoRowsFail(llama.Model):
    """Decoding two rows at once raises, as a GPU out of memory for that batch would."""

    def __call__(self, inputs: Any, cache: Any = None, **kwargs: Any) -> Any:
        if inputs.shape[0] == 2:
            raise ValueError("out of memory for a batch of 2")
        return super().__call__(inputs, cache=cache, **kwargs)


def test_a_warm_up_that_fails_is_said_and_the_core_serves_on(model, caplog):
    failing = TwoRowsFail(model.args)
    failing.update(model.parameters())
    batch = BatchConfig(max_batch_size=4)
    rounds = warm_up.rounds(LetterTokenizer(), batch, context_length=64, model="tiny")
    core = LLMCore("tiny", failing, LetterTokenizer(), batch, warm_up=lambda: rounds)
    core.start()
    # One row at each prompt length (8, 16, 32, 60), one row greedy and at top-p, then the
    # round of two rows, which failed: the last one run.
    assert len(core.warm_up_rounds) == 7
    assert "warm-up stopped: generation failed: out of memory for a batch of 2" in caplog.text
    assert not core.has_work and core.stats == CoreStats()
    seq = sequence([1, 2, 3], max_tokens=4)
    core.add(seq)
    assert len(tokens_of(run(core), seq)) == 4


class CountingCore:
    """A stand-in core for the loop: each step answers one item; `die` kills the thread."""

    def __init__(self, die: threading.Event | None = None):
        self.items: list[str] = []
        self.die = die or threading.Event()

    def start(self) -> None: ...

    @property
    def has_work(self) -> bool:
        return bool(self.items)

    @property
    def waiting(self) -> int:
        return len(self.items)

    def hold_s(self) -> float:
        return 0.0

    def add(self, item: str) -> None:
        self.items.append(item)

    def abort(self, item: str) -> list[tuple[str, str]]:
        self.items.remove(item)
        return [(item, "aborted")]

    def step(self) -> list[tuple[str, str]]:
        if self.die.is_set():
            raise SystemExit("the model thread is gone")  # not an Exception: nothing catches it
        return [(self.items.pop(0), "done")]

    def fail_all(self, message: str, status: int = 500) -> list[tuple[str, str]]:
        failed = [(item, message) for item in self.items]
        self.items.clear()
        return failed


def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.01)


def test_the_loop_delivers_what_each_step_produced():
    delivered: list[list[tuple[str, str]]] = []
    loop = ModelLoop("t", CountingCore(), delivered.append, max_queue=10)
    for item in ("a", "b"):
        loop.submit(item)
    wait_until(lambda: sum(map(len, delivered)) == 2)
    loop.close()
    assert [pair for batch in delivered for pair in batch] == [("a", "done"), ("b", "done")]


def test_the_loop_refuses_past_max_queue():
    loop = ModelLoop("t", CountingCore(), lambda outputs: None, max_queue=0)
    with pytest.raises(Overloaded, match="max_queue=0"):
        loop.submit("a")
    loop.close()


def test_a_dead_model_thread_fails_what_it_held_and_refuses_new_work():
    die = threading.Event()
    delivered: list[tuple[str, str]] = []
    gate = threading.Event()

    def deliver(outputs: list[tuple[str, str]]) -> None:
        delivered.extend(outputs)
        gate.set()

    loop = ModelLoop("t", CountingCore(die), deliver, max_queue=10)
    die.set()
    loop.submit("held")
    wait_until(lambda: loop.failure is not None)
    wait_until(gate.is_set)
    assert "engine thread died: SystemExit" in loop.failure
    assert delivered == [("held", f"model 't' failed ({loop.failure}); it is being restarted")]
    with pytest.raises(Unavailable, match="restarting"):
        loop.submit("late")


class FailingStartCore(CountingCore):
    def start(self) -> None:
        raise RuntimeError("out of memory while warming up")


def test_the_loop_says_started_once_the_core_started_or_died_starting():
    loop = ModelLoop("t", CountingCore(), lambda outputs: None, max_queue=10)
    assert loop.started.wait(10) and loop.failure is None
    loop.close()
    failed = ModelLoop("t", FailingStartCore(), lambda outputs: None, max_queue=10)
    assert failed.started.wait(10)
    assert failed.failure is not None and "out of memory while warming up" in failed.failure


class SlowStepCore(CountingCore):
    """Admits its first item, then takes a long step (a long prefill) until released."""

    def __init__(self, release: threading.Event):
        super().__init__()
        self.release = release
        self.running: list[str] = []

    def step(self) -> list[tuple[str, str]]:
        if self.items:
            self.running.append(self.items.pop(0))
        self.release.wait(10)
        return []


def test_an_item_admitted_in_a_long_step_no_longer_counts_as_waiting():
    release = threading.Event()
    core = SlowStepCore(release)
    loop = ModelLoop("t", core, lambda outputs: None, max_queue=1)
    try:
        loop.submit("first")
        wait_until(lambda: core.running == ["first"])  # admitted; its step still runs
        assert loop.waiting == 0
        loop.submit("second")  # room for one waiting item: not refused
        with pytest.raises(Overloaded):
            loop.submit("third")
    finally:
        release.set()
        loop.close()
