"""Building blocks of the config sections: ids, key lists, the section base, file paths."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationInfo
from pydantic_core import PydanticCustomError

_MODEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@-]*")


def _check_model_id(value: str) -> str:
    if not _MODEL_ID.fullmatch(value):
        raise PydanticCustomError(
            "model_id",
            f"invalid model id {value!r}: use letters, digits and . _ : / @ - "
            "(starting with a letter or digit)",
        )
    return value


ModelId = Annotated[str, AfterValidator(_check_model_id)]
"""A name clients may put in a request's `model` field."""


def _drop_empty_keys(keys: list[str]) -> list[str]:
    # `api_keys: ["${MLXD_API_KEY:-}"]` with the variable unset must mean "open", not "key ''".
    return [key for key in keys if key.strip()]


ApiKeys = Annotated[list[str], AfterValidator(_drop_empty_keys)]


class Section(BaseModel):
    """Every section rejects unknown keys (typos must not pass silently) and is immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def anchored(path: Path, info: ValidationInfo) -> Path:
    """A path from the config file, relative ones taken from the file's directory."""
    path = path.expanduser()
    base_dir = (info.context or {}).get("base_dir")
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    # normpath, not resolve(): tidy `./` and `../` without chasing symlinks.
    return Path(os.path.normpath(path))


ConfigPath = Annotated[Path, AfterValidator(anchored)]
"""A path written in the config file (`anchored` to the file's directory)."""
