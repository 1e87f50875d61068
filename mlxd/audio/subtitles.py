"""Transcript segments as SubRip (srt) and WebVTT text, as OpenAI's response formats."""

from __future__ import annotations

from collections.abc import Sequence

from mlxd.types import Segment


def timestamp(seconds: float, separator: str) -> str:
    millis = round(max(seconds, 0.0) * 1000)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{millis:03d}"


def srt(segments: Sequence[Segment]) -> str:
    return "".join(
        f"{index}\n{timestamp(s.start, ',')} --> {timestamp(s.end, ',')}\n{s.text.strip()}\n\n"
        for index, s in enumerate(segments, 1)
    )


def vtt(segments: Sequence[Segment]) -> str:
    cues = "".join(
        f"{timestamp(s.start, '.')} --> {timestamp(s.end, '.')}\n{s.text.strip()}\n\n"
        for s in segments
    )
    return f"WEBVTT\n\n{cues}"
