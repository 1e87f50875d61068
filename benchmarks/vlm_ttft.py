"""Time to first token of a vision-language request, with one image and text-only.

Builds the tiny random-weight Qwen2-VL of tests/tiny_vlm.py in a temporary directory, serves
it with the real daemon and streams chat completions through the openai SDK, one at a time:
the same prompt with one 64x64 PNG (a data: URL: decoding, the vision tower and the prompt's
prefill with image embeddings all count) and without it. Rounds alternate the two kinds so
that drift in machine load hits both alike; prints min / median / max per kind in ms.

    python -m benchmarks.vlm_ttft [--rounds 20] [--size 64]
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import openai
from PIL import Image

from tests.integration.daemon import start_daemon
from tests.tiny_vlm import build_tiny_vlm

PROMPT = "Describe the image."


def data_url(size: int, seed: int) -> str:
    pixels = (np.random.RandomState(seed).rand(size, size, 3) * 255).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def first_token_s(client: openai.OpenAI, content: str | list) -> float:
    started = time.perf_counter()
    stream = client.chat.completions.create(
        model="vlm",
        max_tokens=4,
        temperature=0,
        messages=[{"role": "user", "content": content}],
        stream=True,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            elapsed = time.perf_counter() - started
            stream.close()
            return elapsed
    raise RuntimeError("no token came back")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--size", type=int, default=64, help="image side in pixels")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = build_tiny_vlm(work / "model", work / "cache")
        config = {
            "server": {"cache_dir": str(work / "cache")},
            "models": {"vlm": {"kind": "vlm", "source": str(model)}},
        }
        (work / "run").mkdir()
        daemon = start_daemon(work / "run", config)
        try:
            client = openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="x", max_retries=0)
            image = [
                {"type": "image_url", "image_url": {"url": data_url(args.size, 0)}},
                {"type": "text", "text": PROMPT},
            ]
            first_token_s(client, image)  # warm-up: first calls compile and allocate
            first_token_s(client, PROMPT)
            times: dict[str, list[float]] = {"one image": [], "text only": []}
            for _ in range(args.rounds):
                times["one image"].append(first_token_s(client, image))
                times["text only"].append(first_token_s(client, PROMPT))
        finally:
            daemon.stop()
    print(f"tiny Qwen2-VL, {args.size}x{args.size} PNG, {args.rounds} rounds, sequential")
    for kind, values in times.items():
        ms = [v * 1000 for v in values]
        print(
            f"{kind:>10}: TTFT min {min(ms):7.1f} ms  median {statistics.median(ms):7.1f} ms"
            f"  max {max(ms):7.1f} ms"
        )


if __name__ == "__main__":
    main()
