"""Rebuild a GGUF file's tokenizer with the `tokenizers` library, and its tokenizer configs.

Two vocabularies cover the supported families: byte-level BPE (`tokenizer.ggml.model == "gpt2"`:
Llama 3, Qwen, SmolLM …), whose pre-tokenizer regex llama.cpp names in `tokenizer.ggml.pre`, and
SentencePiece (`"llama"`: Llama 2, Mistral, Phi-3, Gemma), which llama.cpp runs as BPE over scores:
the pair whose merged piece scores highest merges first, unknown characters fall back to bytes.
"""

from __future__ import annotations

from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from mlxd.models.gguf_errors import UnsupportedTokenizer

# GGUF token types (llama.cpp's llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

SUPPORTED_TOKENIZERS = ("gpt2", "llama")

_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's `tokenizer.ggml.pre` names (llama-vocab.cpp) → the split before byte-level BPE.
# None: GPT-2's own regex; "digits": every digit alone, then GPT-2's regex.
_PRE_TOKENIZERS: dict[str, str | None] = {
    **dict.fromkeys(("default", "gpt-2", "phi-2", "jina-es", "jina-de", "mellum"), None),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell"), "digits"),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2),
    "tekken": _TEKKEN,
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O),
}


def tokenizer_problem(metadata: dict[str, Any]) -> str | None:
    """Why the GGUF's tokenizer cannot be rebuilt, or None."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind not in SUPPORTED_TOKENIZERS:
        return (
            f"tokenizer model {kind!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_TOKENIZERS)})"
        )
    pre = metadata.get("tokenizer.ggml.pre")
    if kind == "gpt2" and pre is not None and pre not in _PRE_TOKENIZERS:
        return f"pre-tokenizer {pre!r} is not supported (supported: {', '.join(_PRE_TOKENIZERS)})"
    missing = [
        key
        for key in ("tokens", "token_type", "merges" if kind == "gpt2" else "scores")
        if f"tokenizer.ggml.{key}" not in metadata
    ]
    if missing:
        return "tokenizer lacks " + ", ".join(f"tokenizer.ggml.{key}" for key in missing)
    return None


def token_id(metadata: dict[str, Any], role: str) -> int | None:
    value = metadata.get(f"tokenizer.ggml.{role}_token_id")
    return None if value is None else int(value)


def _byte_level_pre_tokenizer(name: str | None) -> pre_tokenizers.PreTokenizer:
    split = _PRE_TOKENIZERS.get(name or "default")
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == "digits":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _score_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges from SentencePiece scores: every split of a piece into two pieces, the
    merges of higher-scoring results first (what llama.cpp's SPM tokenizer does)."""
    vocab = {token: i for i, token in enumerate(tokens)}
    found = []
    for token, score in zip(tokens, scores, strict=True):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                found.append((-score, vocab[token], vocab[left], vocab[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _sentencepiece(metadata: dict[str, Any], tokens: list[str], types: list[int]) -> Tokenizer:
    unk = token_id(metadata, "unknown")
    tokenizer = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=_score_merges(tokens, [float(s) for s in metadata["tokenizer.ggml.scores"]]),
            unk_token=tokens[unk] if unk is not None else None,
            fuse_unk=True,
            byte_fallback=_BYTE in types,
        )
    )
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    # As llama.cpp: spaces become "▁" and, unless told otherwise, one "▁" starts the text (even
    # text that starts with a space, which a Metaspace pre-tokenizer would leave alone).
    steps = [normalizers.Prepend("▁")] if prefix else []
    tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        decode.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(decode)
    return tokenizer


def _byte_level_bpe(metadata: dict[str, Any], tokens: list[str]) -> Tokenizer:
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    )
    tokenizer.pre_tokenizer = _byte_level_pre_tokenizer(metadata.get("tokenizer.ggml.pre"))
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def build_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    """The GGUF's tokenizer as a `tokenizers.Tokenizer`; UnsupportedTokenizer if it cannot be."""
    if problem := tokenizer_problem(metadata):
        raise UnsupportedTokenizer(problem)
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    types = [int(t) for t in metadata["tokenizer.ggml.token_type"]]
    kind = metadata["tokenizer.ggml.model"]
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(metadata, tokens)
        post: list[processors.PostProcessor] = [processors.ByteLevel(trim_offsets=False)]
        add_bos_default = False
    else:
        tokenizer = _sentencepiece(metadata, tokens, types)
        post = []
        add_bos_default = True  # llama.cpp's default for SentencePiece vocabularies
    bos = token_id(metadata, "bos")
    if bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None:
        post.append(
            processors.TemplateProcessing(
                single=f"{tokens[bos]} $A",
                pair=f"{tokens[bos]} $A {tokens[bos]} $B",
                special_tokens=[(tokens[bos], bos)],
            )
        )
    if post:
        tokenizer.post_processor = processors.Sequence(post)

    def added(kind: int, special: bool) -> list[AddedToken]:
        return [
            AddedToken(tokens[i], special=special, normalized=False)
            for i, t in enumerate(types)
            if t == kind
        ]

    tokenizer.add_special_tokens(added(_CONTROL, special=True))
    tokenizer.add_tokens(added(_USER_DEFINED, special=False))
    return tokenizer


def tokenizer_config(metadata: dict[str, Any], context_length: int | None) -> dict[str, Any]:
    """tokenizer_config.json: special token strings and the chat template."""
    tokens = metadata["tokenizer.ggml.tokens"]
    sentencepiece = metadata.get("tokenizer.ggml.model") == "llama"
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", sentencepiece)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length or 2048,
    }
    for role, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        if (token := token_id(metadata, key)) is not None:
            config[f"{role}_token"] = tokens[token]
    if template := metadata.get("tokenizer.chat_template"):
        config["chat_template"] = template
    return config


def generation_config(metadata: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json: mlx-lm reads its eos ids as the stop tokens."""
    eos = [
        token
        for token in (token_id(metadata, "eos"), token_id(metadata, "eot"))
        if token is not None
    ]
    config = {
        "bos_token_id": token_id(metadata, "bos"),
        "eos_token_id": list(dict.fromkeys(eos)),
        "pad_token_id": token_id(metadata, "padding"),
    }
    return {key: value for key, value in config.items() if value not in (None, [])}
