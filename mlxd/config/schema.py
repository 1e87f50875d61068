"""The whole YAML file as pydantic models; their field descriptions become the config
reference. The checks that need every model at once (aliases, draft models) live here."""

from __future__ import annotations

from typing import Any

from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from mlxd.config.fields import ModelId, Section
from mlxd.config.model import ModelConfig
from mlxd.config.sections import DraftWeights
from mlxd.config.server import ServerConfig


class Config(Section):
    """A whole config file: the server section and every model, keyed by name."""

    server: ServerConfig = Field(default_factory=ServerConfig, description="Server settings.")
    models: dict[ModelId, ModelConfig] = Field(
        default_factory=dict, description="Served models by name; the name is the default id."
    )
    _routes: dict[str, str] = PrivateAttr(default_factory=dict)

    @field_validator("server", "models", mode="before")
    @classmethod
    def _empty_section(cls, value: Any) -> Any:
        # `models:` with every entry commented out is YAML null: treat it as an empty section.
        return {} if value is None else value

    @model_validator(mode="after")
    def _build_routes(self) -> Config:
        routes = {name: name for name in self.models}
        errors: list[InitErrorDetails] = []
        for name, model in self.models.items():
            for index, alias in enumerate(model.aliases):
                owner = routes.setdefault(alias, name)
                if owner == name:
                    continue
                clash = (
                    f"is the name of model {owner!r}"
                    if owner == alias
                    else f"is already an alias of model {owner!r}"
                )
                errors.append(
                    InitErrorDetails(
                        type=PydanticCustomError(
                            "alias_collision", f"alias {alias!r} of model {name!r} {clash}"
                        ),
                        loc=("models", name, "aliases", index),
                        input=alias,
                    )
                )
        if errors:
            # A ValidationError (not a ValueError) keeps each clash's own location for the loader.
            raise ValidationError.from_exception_data(type(self).__name__, errors)
        self._routes = routes
        return self

    @model_validator(mode="after")
    def _resolve_drafts(self) -> Config:
        errors: list[InitErrorDetails] = []
        for name, model in self.models.items():
            speculative = model.speculative
            draft_name = speculative.model if speculative else None
            if speculative is None or draft_name is None:
                continue
            draft = self.models.get(draft_name)
            if draft is None or draft.kind != "llm" or draft_name == name:
                errors.append(
                    InitErrorDetails(
                        type=PydanticCustomError(
                            "draft_model",
                            f"speculative.model {draft_name!r} of model {name!r} must "
                            "name another llm model in this file",
                        ),
                        loc=("models", name, "speculative", "model"),
                        input=draft_name,
                    )
                )
                continue
            # On copies: the configs may be the caller's (and shared with another Config).
            speculative = speculative.model_copy()
            speculative._draft = DraftWeights(draft_name, draft.source, draft.dtype)
            self.models[name] = model.model_copy(update={"speculative": speculative})
        if errors:
            raise ValidationError.from_exception_data(type(self).__name__, errors)
        return self

    @model_validator(mode="after")
    def _any_origin_needs_keys(self) -> Config:
        keyed = self.server.api_keys or any(model.api_keys for model in self.models.values())
        if "*" in self.server.cors_origins and not keyed:
            index = self.server.cors_origins.index("*")
            error = InitErrorDetails(
                type=PydanticCustomError(
                    "cors_any_origin",
                    "'*' lets every web page call the daemon: it needs api_keys to be set",
                ),
                loc=("server", "cors_origins", index),
                input="*",
            )
            raise ValidationError.from_exception_data(type(self).__name__, [error])
        return self

    def routes(self) -> dict[str, str]:
        """Every id clients may use (model names and aliases) mapped to its model's name."""
        return dict(self._routes)

    def resolve(self, model_id: str) -> str | None:
        """The name of the model that `model_id` (a name or an alias) refers to, if any."""
        return self._routes.get(model_id)

    def ids(self) -> list[str]:
        """All ids clients may use: model names, then aliases, each in file order."""
        return list(self._routes)
