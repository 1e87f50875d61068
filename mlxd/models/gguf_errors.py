"""Why a GGUF file does not import: unreadable, or readable but unsupported (which says what)."""


class GGUFError(ValueError):
    """A GGUF file that is unreadable or describes a model this importer does not support."""


class UnsupportedGGUF(GGUFError):
    """A readable GGUF file this importer cannot convert: the same every time it is tried."""


class UnsupportedArchitecture(UnsupportedGGUF):
    """An architecture, or a tensor or setting of it, with no mlx-lm mapping here."""


class UnsupportedQuantType(UnsupportedGGUF):
    """A GGML tensor type that neither MLX nor the `gguf` package's dequantizer knows."""


class UnsupportedTokenizer(UnsupportedGGUF):
    """A tokenizer model or pre-tokenizer that cannot be rebuilt with `tokenizers`."""
