"""Log setup: human-readable lines, or one JSON object per line for log shippers."""

from __future__ import annotations

import json
import logging
import os
from datetime import UTC, datetime
from typing import Literal

TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """`{"ts", "level", "logger", "message", ...}`; a record's `fields` extra (the per-request
    line carries one) is merged in as top-level keys."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **getattr(record, "fields", {}),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def setup_logging(level: str, fmt: Literal["text", "json"]) -> None:
    # transformers (tokenizers and chat templates only; no torch) prints an advisory on import
    # through its own handler: noise to an operator, and not JSON.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
