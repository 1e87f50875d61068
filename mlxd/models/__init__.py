"""Where weights come from (local dir, .gguf, pkg://, hf://) and loading them into MLX."""
