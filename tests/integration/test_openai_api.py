"""The OpenAI API end to end: the real daemon, the real SmolLM2 weights, the official SDK."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.integration.daemon import SMOL_GGUF, Daemon, start_daemon

pytestmark = pytest.mark.integration

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path):
    workdir = tmp_path_factory.mktemp("openai-api")
    config = {
        "server": {"cache_dir": str(mlxd_cache_dir), "max_request_bytes": "64KiB"},
        "models": {
            "smol": {
                "source": SMOL_GGUF,
                "aliases": ["default", "gpt-4o-mini"],
                "context_length": 256,
                "batch": {"max_batch_size": 8, "prefill_batch_size": 8},
                "defaults": {"max_tokens": 32, "temperature": 0.0},
            },
            "broken": {"source": str(workdir / "no-such-model")},
        },
    }
    running = start_daemon(workdir, config)
    yield running
    running.stop()


@pytest.fixture
def client(daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="unused", max_retries=0)


def test_france_answers_paris(client: openai.OpenAI):
    reply = client.chat.completions.create(model="smol", messages=FRANCE, temperature=0)
    choice = reply.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"
    assert reply.usage.prompt_tokens > 5
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_alias_routes_to_the_same_model(client: openai.OpenAI):
    reply = client.chat.completions.create(model="gpt-4o-mini", messages=FRANCE, temperature=0)
    assert reply.model == "gpt-4o-mini"
    assert "Paris" in reply.choices[0].message.content


def test_stream_concatenates_to_the_non_streamed_text(client: openai.OpenAI):
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(
        model="smol", messages=messages, temperature=0, max_tokens=24
    )
    stream = client.chat.completions.create(
        model="smol",
        messages=messages,
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_concurrent_requests_share_decode_steps(daemon: Daemon):
    before = daemon.status()["models"]["smol"]["multi_sequence_steps"]

    async def ask(client: openai.AsyncOpenAI, i: int) -> str:
        reply = await client.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": f"Count from {i} to {i + 20}."}],
            temperature=0,
            max_tokens=24,
        )
        return reply.choices[0].message.content

    async def main() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{daemon.url}/v1", api_key="x", max_retries=0)
        return await asyncio.gather(*(ask(client, i) for i in range(8)))

    answers = asyncio.run(main())
    assert len(answers) == 8 and all(answers)
    stats = daemon.status()["models"]["smol"]
    assert stats["multi_sequence_steps"] > before
    assert stats["max_batch_seen"] > 1
    assert stats["running"] == 0


def test_aborted_stream_frees_its_slot(daemon: Daemon):
    cancelled_before = daemon.status()["models"]["smol"]["cancelled"]
    body = {
        "model": "smol",
        "messages": [{"role": "user", "content": "Tell me a very long story."}],
        "max_tokens": 200,
        "temperature": 0.7,
        "stream": True,
    }
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{daemon.url}/v1/chat/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        assert sum(1 for line, _ in zip(lines, range(6), strict=False) if line) >= 3
    stats = daemon.wait_for_cancel("smol", cancelled_before)
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["cancelled"] == cancelled_before + 1
    assert stats["generated_tokens"] > 0


def test_stop_string_ends_the_answer(client: openai.OpenAI):
    reply = client.chat.completions.create(
        model="smol", messages=FRANCE, temperature=0, stop=["Paris"]
    )
    assert "Paris" not in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"


def test_max_tokens_gives_length(client: openai.OpenAI):
    reply = client.chat.completions.create(
        model="smol", messages=FRANCE, temperature=0, max_tokens=3
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 3


def test_seeded_sampling_is_reproducible(client: openai.OpenAI):
    def sample() -> str:
        return (
            client.chat.completions.create(
                model="smol", messages=FRANCE, temperature=1.0, seed=7, max_tokens=12
            )
            .choices[0]
            .message.content
        )

    assert sample() == sample()


def test_seeded_top_p_sampling_repeats_beside_other_requests(client: openai.OpenAI):
    """Top-p rows are drawn in one batched call: a seeded one draws its own tokens whatever
    requests share its batch."""

    def ask(seed: int | None, content: str = "Tell me a story about a fox.") -> str:
        reply = client.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": content}],
            temperature=0.7,
            top_p=0.9,
            seed=seed,
            max_tokens=24,
        )
        return reply.choices[0].message.content or ""

    alone = ask(11)
    with ThreadPoolExecutor(4) as pool:
        beside = [pool.submit(ask, None, "Name three birds."), pool.submit(ask, 5)]
        again = pool.submit(ask, 11)
        beside.append(pool.submit(ask, None))
        assert again.result() == alone
        assert all(future.result() for future in beside)


def test_logprobs(client: openai.OpenAI):
    reply = client.chat.completions.create(
        model="smol", messages=FRANCE, temperature=0, max_tokens=4, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert len(content) >= 1
    first = content[0]
    assert first.logprob <= 0 and len(first.top_logprobs) == 3
    # Greedy decoding picks the most likely token.
    assert first.token == first.top_logprobs[0].token


def test_text_completion(client: openai.OpenAI):
    reply = client.completions.create(
        model="smol", prompt="The capital of France is", max_tokens=5, temperature=0, logprobs=2
    )
    choice = reply.choices[0]
    assert choice.text
    assert choice.finish_reason in ("stop", "length")
    assert len(choice.logprobs.tokens) == reply.usage.completion_tokens


def test_text_completion_stream(client: openai.OpenAI):
    kwargs = {"model": "smol", "prompt": "1, 2, 3,", "max_tokens": 8, "temperature": 0}
    whole = client.completions.create(**kwargs).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True))
    assert streamed == whole


def test_models_lists_names_and_aliases(client: openai.OpenAI):
    ids = {m.id for m in client.models.list().data}
    assert {"smol", "default", "gpt-4o-mini", "broken"} <= ids


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (b'{"messages": [{"role": "user", "content": "hi"}]}', 400, "model"),
        (b'{"model": "smol"}', 400, "messages"),
        (b'{"model": "smol", "messages": []}', 400, "messages"),
        (b'{"model": "smol", "messages": [{"role": "wizard", "content": "hi"}]}', 400, "role"),
        (
            b'{"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}',
            400,
            "max_tokens",
        ),
        (
            b'{"model": "smol", "messages": [{"role": "user", "content": "hi"}], '
            b'"temperature": "hot"}',
            400,
            "temperature",
        ),
        (b'{"model": "smol", "messages": [{"role": "user", "content": "hi"}], "n": 17}', 400, "n"),
        (b'{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}', 404, "smol"),
        (
            b'{"model": "broken", "messages": [{"role": "user", "content": "hi"}]}',
            503,
            "no-such-model",
        ),
    ],
)
def test_bad_chat_requests(daemon: Daemon, body: bytes, status: int, needle: str):
    response = httpx.post(
        f"{daemon.url}/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert needle in error["message"] or needle == error["param"], error
    assert error["type"]


def test_oversized_prompt_is_rejected(client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "word " * 400}], max_tokens=4
        )
    assert "context" in caught.value.message


def test_oversized_body_is_413(daemon: Daemon):
    big = {"model": "smol", "messages": [{"role": "user", "content": "x" * 100_000}]}
    response = httpx.post(f"{daemon.url}/v1/chat/completions", json=big, timeout=30)
    assert response.status_code == 413
    assert "max_request_bytes" in response.json()["error"]["message"]


def test_unknown_route_and_method(daemon: Daemon):
    assert httpx.get(f"{daemon.url}/v1/nothing").status_code == 404
    assert httpx.get(f"{daemon.url}/v1/chat/completions").status_code == 405


def test_unknown_model_through_the_sdk(client: openai.OpenAI):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-5", messages=FRANCE)
    assert "smol" in caught.value.message


def test_failed_model_shows_in_health_and_the_rest_serves(daemon: Daemon, client):
    health = httpx.get(f"{daemon.url}/health").json()
    assert health["status"] == "degraded"
    assert health["models"] == {"smol": "loaded", "broken": "failed"}
    assert "broken" in daemon.status()["models"]["broken"]["error"]
    reply = client.chat.completions.create(model="smol", messages=FRANCE, temperature=0)
    assert "Paris" in reply.choices[0].message.content


def test_logit_bias_forces_a_token(client: openai.OpenAI):
    reply = client.completions.create(
        model="smol",
        prompt="Hello",
        max_tokens=4,
        temperature=0,
        logit_bias={"330": 100},
        logprobs=0,
    )
    tokens = reply.choices[0].logprobs.tokens
    assert len(tokens) == 4 and len(set(tokens)) == 1, tokens


def test_penalties_are_accepted_and_change_nothing_structural(client: openai.OpenAI):
    reply = client.chat.completions.create(
        model="smol",
        messages=FRANCE,
        temperature=0,
        max_tokens=16,
        presence_penalty=1.5,
        frequency_penalty=1.0,
        extra_body={"repetition_penalty": 1.3, "top_k": 20, "min_p": 0.05},
    )
    assert reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length")


# -- issue 14: n, several prompts, echo, streamed logprobs, every id's model card ---------


def test_n_choices_share_one_prompt_in_usage(client: openai.OpenAI):
    single = client.chat.completions.create(model="smol", messages=FRANCE, max_tokens=6)
    reply = client.chat.completions.create(
        model="smol", messages=FRANCE, n=3, temperature=1.0, seed=7, max_tokens=6
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert all(c.message.content and c.finish_reason for c in reply.choices)
    # The prompt counts once; every choice's tokens count.
    assert reply.usage.prompt_tokens == single.usage.prompt_tokens
    assert reply.usage.completion_tokens > 6 and reply.usage.completion_tokens <= 18
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    # Seeds differ per choice (seed + index): choice 0 is the single seeded request.
    again = client.chat.completions.create(
        model="smol", messages=FRANCE, temperature=1.0, seed=7, max_tokens=6
    )
    assert reply.choices[0].message.content == again.choices[0].message.content


def test_n_streamed_choices_each_finish(client: openai.OpenAI):
    stream = client.chat.completions.create(
        model="smol",
        messages=FRANCE,
        n=2,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, finishes, usage = {0: "", 1: ""}, {}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert set(finishes) == {0, 1}
    assert texts[0] == texts[1] and "Paris" in texts[0]  # greedy: the same answer twice
    assert usage.completion_tokens == 2 * usage.completion_tokens // 2 > 0


def test_several_prompts_times_n_with_echo(client: openai.OpenAI):
    prompts = ["The capital of France is", "One, two, three,"]
    reply = client.completions.create(
        model="smol", prompt=prompts, n=2, max_tokens=4, echo=True, temperature=0
    )
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    for choice in reply.choices:
        assert choice.text.startswith(prompts[choice.index // 2])
        assert len(choice.text) > len(prompts[choice.index // 2])
    alone = [
        client.completions.create(model="smol", prompt=p, max_tokens=4, temperature=0)
        for p in prompts
    ]
    assert reply.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert reply.choices[2].text == prompts[1] + alone[1].choices[0].text
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(
        model="smol", prompt=prompts, max_tokens=4, echo=True, temperature=0, stream=True
    ):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {0: reply.choices[0].text, 1: reply.choices[2].text}


def test_streamed_chat_logprobs(client: openai.OpenAI):
    stream = client.chat.completions.create(
        model="smol", messages=FRANCE, logprobs=True, top_logprobs=2, max_tokens=8, stream=True
    )
    text, tokens = "", []
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.logprobs and choice.logprobs.content:
                tokens.extend(choice.logprobs.content)
    assert len(tokens) == 8
    assert "".join(t.token for t in tokens).strip().startswith(text.strip()[:5])
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in tokens)


def test_model_card_for_every_id(client: openai.OpenAI):
    for model_id in ("smol", "default", "gpt-4o-mini"):
        card = client.models.retrieve(model_id)
        assert card.id == model_id and card.root == "smol"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_leaving_an_n_stream_cancels_every_sequence(daemon: Daemon):
    before = daemon.status()["models"]["smol"]["cancelled"]
    body = {
        "model": "smol",
        "messages": [{"role": "user", "content": "Tell me a very long story."}],
        "max_tokens": 200,
        "n": 3,
        "temperature": 0.7,
        "stream": True,
    }
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{daemon.url}/v1/chat/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        assert sum(1 for line, _ in zip(lines, range(14), strict=False) if line) >= 6
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = daemon.status()["models"]["smol"]
        if stats["cancelled"] >= before + 3 and stats["running"] == 0:
            break
        time.sleep(0.2)
    assert stats["cancelled"] == before + 3
    assert stats["running"] == 0 and stats["waiting"] == 0
