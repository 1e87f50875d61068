#!/usr/bin/env bash
# OpenAI-style requests against a local mlxd (make serve). Set MLXD_URL to point elsewhere.
set -euo pipefail
URL=${MLXD_URL:-http://localhost:8000}

curl -s "$URL/v1/models"; echo

curl -s "$URL/v1/chat/completions" -H 'content-type: application/json' -d '{
  "model": "smol",
  "messages": [{"role": "user", "content": "What is the capital of France?"}],
  "temperature": 0
}'; echo

# Streaming: server-sent events ending with data: [DONE]
curl -sN "$URL/v1/chat/completions" -H 'content-type: application/json' -d '{
  "model": "default",
  "messages": [{"role": "user", "content": "Name three colours."}],
  "stream": true,
  "stream_options": {"include_usage": true},
  "max_tokens": 32
}'

curl -s "$URL/v1/completions" -H 'content-type: application/json' -d '{
  "model": "smol", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0
}'; echo

# Embeddings (the shipped config's all-MiniLM-L6-v2): 384 floats per input.
curl -s "$URL/v1/embeddings" -H 'content-type: application/json' -d '{
  "model": "text-embedding-3-small", "input": ["a cat", "a dog"], "dimensions": 8
}'; echo
