"""A tiny random-weight KittenTTS model directory (mlx-audio's kitten_tts architecture): the
plumbing of kind tts without real voices, which no pip package ships."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

VOICES = ("expr-voice-2-f", "expr-voice-3-m")
CONFIG = {
    "model_type": "kitten_tts",
    "hidden_dim": 32,
    "max_conv_dim": 32,
    "max_dur": 4,  # short sounds per phoneme: short clips, quick tests
    "n_layer": 1,
    "n_mels": 80,
    "n_token": 178,
    "style_dim": 128,  # mlx-audio's KittenTTS splits a voice's 256 values at 128
    "text_encoder_kernel_size": 5,
    "asr_res_dim": 16,
    "decoder_out_dim": 32,
    "sample_rate": 24000,
    "voices_path": "voices.npz",
    "plbert": {
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "max_position_embeddings": 512,
        "embedding_size": 16,
        "inner_group_num": 1,
        "num_hidden_groups": 1,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "type_vocab_size": 2,
        "layer_norm_eps": 1e-12,
    },
    "istftnet": {
        "resblock_kernel_sizes": [3],
        "upsample_rates": [10, 6],
        "upsample_initial_channel": 32,
        "resblock_dilation_sizes": [[1, 3, 5]],
        "upsample_kernel_sizes": [20, 12],
        "gen_istft_n_fft": 20,
        "gen_istft_hop_size": 5,
    },
}


def build_tiny_tts(directory: Path) -> Path:
    from mlx_audio.tts.models.kitten_tts import Model, ModelConfig

    model = Model(ModelConfig.from_dict(CONFIG))
    rng = np.random.default_rng(0)

    def init(name: str, value: mx.array) -> mx.array:
        # Small matrices (N(0, 0.05)); norms, biases and Snake alphas as built. mlx's default
        # init makes this random vocoder overflow to NaN.
        if value.ndim < 2 or any(part in name for part in ("norm", "gamma", "alpha")):
            return value
        return mx.array(rng.normal(0, 0.05, value.shape).astype(np.float32))

    weights = {name: init(name, value) for name, value in tree_flatten(model.parameters())}
    mx.save_safetensors(str(directory / "model.safetensors"), weights)
    (directory / "config.json").write_text(json.dumps(CONFIG))
    styles = {v: rng.normal(0, 0.1, (400, 256)).astype(np.float32) for v in VOICES}
    np.savez(directory / "voices.npz", **styles)
    return directory
