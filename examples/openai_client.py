"""The official openai SDK against mlxd: `python examples/openai_client.py` after `make serve`."""

import os

from openai import OpenAI

client = OpenAI(
    base_url=os.environ.get("MLXD_URL", "http://localhost:8000") + "/v1",
    api_key=os.environ.get("MLXD_API_KEY", "unused"),
)

print([m.id for m in client.models.list().data])

reply = client.chat.completions.create(
    model="smol",
    messages=[{"role": "user", "content": "What is the capital of France?"}],
    temperature=0,
)
print(reply.choices[0].message.content, reply.usage)

stream = client.chat.completions.create(
    model="smol",
    messages=[{"role": "user", "content": "Write a haiku about home servers."}],
    stream=True,
    stream_options={"include_usage": True},
)
for chunk in stream:
    if chunk.choices:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
    elif chunk.usage:
        print(f"\n[{chunk.usage.completion_tokens} tokens]")
