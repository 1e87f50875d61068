"""GGUF tokenizers rebuilt with `tokenizers`: SentencePiece against the sentencepiece library,
byte-level BPE pre-tokenizers by llama.cpp's names, and a tokenizer through a full import."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import sentencepiece as spm
from tokenizers import pre_tokenizers

from mlxd.models.gguf import convert_gguf
from mlxd.models.gguf_tokenizer import build_tokenizer
from tests.tiny_gguf import tiny_config, tiny_weights, write_gguf
from tests.unit.test_gguf import tiny_metadata

CORPUS = [
    "The capital of France is Paris.",
    "Hello world! Hello there, how are you today?",
    "Numbers like 2024 and 31415 appear in text.",
    "Tokenizers split words into pieces: tokenization, tokenizer, tokens.",
    "    indented code(); with_underscores and CamelCase",
] * 20
SAMPLES = [
    "Hello world",
    "The capital of France is Paris.",
    "  two leading spaces and trailing ",
    "unseen ü ñ 漢字 and emoji 🙂 fall back to bytes",
    "line\nbreak\tand tab 12345",
]


@pytest.fixture(scope="module")
def sentencepiece_model() -> spm.SentencePieceProcessor:
    """A small BPE SentencePiece model trained as Llama's was (byte fallback, digits split)."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_writer=model,
        model_type="bpe",
        vocab_size=400,
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        character_coverage=1.0,
        bos_id=1,
        eos_id=2,
        unk_id=0,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def sentencepiece_vocab(sp: spm.SentencePieceProcessor) -> dict:
    """What convert_hf_to_gguf.py's _create_vocab_sentencepiece writes for this model."""
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            types.append(2)
        elif sp.is_control(i):
            types.append(3)
        elif sp.is_unused(i):
            types.append(5)
        elif sp.is_byte(i):
            types.append(6)
        else:
            types.append(1)
    return {"model": "llama", "tokens": tokens, "types": types, "scores": scores}


def spm_metadata(vocab: dict) -> dict:
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": vocab["tokens"],
        "tokenizer.ggml.scores": vocab["scores"],
        "tokenizer.ggml.token_type": vocab["types"],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


@pytest.mark.parametrize("text", SAMPLES)
def test_sentencepiece_matches_the_sentencepiece_library(
    sentencepiece_model: spm.SentencePieceProcessor, text: str
) -> None:
    tokenizer = build_tokenizer(spm_metadata(sentencepiece_vocab(sentencepiece_model)))
    ids = tokenizer.encode(text).ids
    assert ids[0] == 1  # llama.cpp adds BOS for SentencePiece vocabularies by default
    assert ids[1:] == sentencepiece_model.encode(text)
    assert tokenizer.decode(ids) == sentencepiece_model.decode(ids[1:]) == text


def test_sentencepiece_without_space_prefix(
    sentencepiece_model: spm.SentencePieceProcessor,
) -> None:
    # Gemma's GGUFs say add_space_prefix = false: no "▁" is prepended to the text.
    metadata = {
        **spm_metadata(sentencepiece_vocab(sentencepiece_model)),
        "tokenizer.ggml.add_space_prefix": False,
        "tokenizer.ggml.add_bos_token": False,
    }
    tokenizer = build_tokenizer(metadata)
    pieces = tokenizer.encode("Hello world").tokens
    assert not pieces[0].startswith("▁") and any(p.startswith("▁w") for p in pieces)
    assert tokenizer.decode(tokenizer.encode("Hello world").ids) == "Hello world"


@pytest.mark.parametrize(
    ("pre", "text", "pieces"),
    [
        ("gpt-2", "x 12345", ["x", "Ġ12345"]),
        ("default", "I'm", ["I", "'m"]),
        ("llama-bpe", "x 12345", ["x", "Ġ", "123", "45"]),
        ("llama3", "I'M", ["I", "'M"]),
        ("qwen2", "x 12345", ["x", "Ġ", "1", "2", "3", "4", "5"]),
        ("smollm", "x 12345", ["x", "Ġ", "1", "2", "3", "4", "5"]),
        ("tekken", "HelloWorld", ["Hello", "World"]),
        ("gpt-4o", "x 12345", ["x", "Ġ", "123", "45"]),
    ],
)
def test_byte_level_pre_tokenizers(pre: str, text: str, pieces: list[str]) -> None:
    tokenizer = build_tokenizer({**tiny_metadata(), "tokenizer.ggml.pre": pre})
    assert tokenizer.pre_tokenizer is not None
    split = [piece for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)]
    assert split == pieces


def test_sentencepiece_gguf_imports_with_its_chat_template(
    tmp_path: Path, sentencepiece_model: spm.SentencePieceProcessor
) -> None:
    vocab = sentencepiece_vocab(sentencepiece_model)
    template = "{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
    vocab["extra"] = {"chat_template": template, "unk_token_id": 0}
    # Mistral-shaped: a llama-architecture GGUF with a SentencePiece vocabulary.
    config = tiny_config("llama", vocab_size=len(vocab["tokens"]))
    write_gguf(tmp_path / "m.gguf", config, tiny_weights(config), vocab=vocab)
    out = tmp_path / "out"
    out.mkdir()
    convert_gguf(tmp_path / "m.gguf", out)

    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out))
    assert tokenizer.encode("Hello world") == [1, *sentencepiece_model.encode("Hello world")]
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == template
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert rendered == "[INST] hi [/INST]"


def test_byte_level_alphabet_is_complete() -> None:
    # The helper vocabulary covers every byte, so any text encodes without unknowns.
    assert len(pre_tokenizers.ByteLevel.alphabet()) == 256
