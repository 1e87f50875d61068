"""Process-level settings: CLI flags and MLXD_* environment variables, not the YAML file."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from mlxd.config.server import ServerConfig


class Settings(BaseSettings):
    """How this process runs. `host`/`port`, when set, win over the YAML `server` section."""

    # extra="ignore": MLXD_API_KEY and friends are for ${...} interpolation in the YAML file.
    model_config = SettingsConfigDict(env_prefix="MLXD_", extra="ignore", frozen=True)

    config: Path = Field(Path("config/models.yaml"), description="The YAML config file.")
    host: str | None = Field(None, description="Listen address; overrides server.host.")
    port: int | None = Field(None, ge=1, le=65535, description="Port; overrides server.port.")
    log_level: Literal["debug", "info", "warning", "error", "critical"] = Field(
        "info", description="Logging threshold."
    )
    log_format: Literal["text", "json"] = Field("text", description="Log line format.")
    no_reexec: bool = Field(
        False,
        description="Do not re-exec the process with an optimized BLAS preloaded and glibc's "
        "transparent huge pages asked for.",
    )

    @field_validator("log_level", mode="before")
    @classmethod
    def _lowercase(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    def apply_to(self, server: ServerConfig) -> ServerConfig:
        """`server` with this process's host/port overrides applied."""
        overrides = {"host": self.host, "port": self.port}
        return server.model_copy(update={k: v for k, v in overrides.items() if v is not None})
