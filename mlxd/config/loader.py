"""YAML text → validated `Config`, with `${ENV}` interpolation and `FILE:LINE: key.path:` errors.

PyYAML's plain `safe_load` forgets where things came from, so the file is composed into a node
tree and converted by hand, recording the line of every key and list item. Pydantic's error
locations are then mapped back onto those lines.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Any, TypeGuard, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from mlxd.config.schema import Config
from mlxd.errors import ConfigError

Loc = tuple[str | int, ...]
ExtraCheck = Callable[[Config], list[tuple[Loc, str]]]
"""Checks beyond the schema (e.g. against the model's own files) for `mlxd check`: each
problem is the YAML location it is about and a message."""

_REFERENCE = re.compile(r"\$\$\{|\$\{(?P<body>[^}]*)\}|\$\{")
_VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# Pydantic's built-in messages, reworded for people editing YAML; ctx fills the placeholders.
_MESSAGES = {
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be a whole number",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be a mapping",
    "model_type": "must be a mapping",
    "string_too_short": "must not be empty",
    "greater_than": "must be > {gt}",
    "greater_than_equal": "must be >= {ge}",
    "less_than": "must be < {lt}",
    "less_than_equal": "must be <= {le}",
    "literal_error": "must be one of {expected}",
}


@dataclass(frozen=True)
class _Problem:
    line: int
    path: Loc
    message: str

    def render(self, filename: str) -> str:
        where = f"{filename}:{self.line}: "
        return where + (f"{_dotted(self.path)}: " if self.path else "") + self.message


class _InterpolationError(Exception):
    pass


def load_config(path: str | Path, extra_checks: ExtraCheck | None = None) -> Config:
    """Read and validate a config file. Raises ConfigError with every problem found."""
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    return parse_config(text, filename=str(path), extra_checks=extra_checks)


def parse_config(
    text: str,
    filename: str = "<string>",
    env: Mapping[str, str] | None = None,
    extra_checks: ExtraCheck | None = None,
) -> Config:
    """Validate config text. Relative model sources are anchored to `filename`'s directory
    (the current directory for a pseudo-name such as `<string>`). `extra_checks` runs on a
    registry that passed the schema; its problems are reported with their lines too."""
    reader = _TreeReader(os.environ if env is None else env)
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = {} if root is None else reader.convert(root, ())
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = f"{mark.line + 1}:" if mark else ""
        detail = ", ".join(part for part in (exc.context, exc.problem) if part)
        raise ConfigError(f"{filename}:{line} YAML syntax error: {detail}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{filename}: YAML syntax error: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{filename}:{root.start_mark.line + 1}: the top level must be a mapping "
            "with 'server' and 'models' keys"
        )

    problems = list(reader.problems)
    base_dir = Path.cwd() if filename.startswith("<") else Path(filename).parent.absolute()
    try:
        config = Config.model_validate(data, context={"base_dir": base_dir})
    except ValidationError as exc:
        for error in exc.errors(include_url=False):
            problem = _from_pydantic(error, reader.lines)
            # A value whose interpolation failed was already reported; its raw text is noise.
            if problem.path not in reader.failed:
                problems.append(problem)
    else:
        for loc, message in extra_checks(config) if extra_checks and not problems else ():
            problems.append(_Problem(_line_of(loc, reader.lines), loc, message))
    if problems:
        unique = dict.fromkeys(problems)  # dedupe, keeping pydantic's order within a line
        ordered = sorted(unique, key=lambda problem: problem.line)
        raise ConfigError("\n".join(problem.render(filename) for problem in ordered))
    return config


class _TreeReader:
    """Converts a composed YAML node tree to plain data, remembering each location's line."""

    def __init__(self, env: Mapping[str, str]):
        self.env = env
        self.lines: dict[Loc, int] = {}
        self.problems: list[_Problem] = []
        self.failed: set[Loc] = set()  # locations whose value was reported as unreadable
        self._open: set[int] = set()  # collection nodes being converted, to stop `&a [*a]`
        # A loader instance lends us PyYAML's scalar typing (ints, bools, null) and merge keys.
        self._yaml = yaml.SafeLoader("")

    def convert(self, node: yaml.Node, loc: Loc) -> Any:
        line = node.start_mark.line + 1
        self.lines.setdefault(loc, line)
        if isinstance(node, yaml.ScalarNode):
            return self._scalar(node, loc)
        if id(node) in self._open:
            self.problems.append(_Problem(line, loc, "an anchor may not contain itself"))
            self.failed.add(loc)
            return None
        self._open.add(id(node))
        try:
            if isinstance(node, yaml.MappingNode):
                return self._mapping(node, loc)
            return [self.convert(item, (*loc, i)) for i, item in enumerate(node.value)]
        finally:
            self._open.discard(id(node))

    def _mapping(self, node: yaml.MappingNode, loc: Loc) -> dict[str, Any]:
        own_pairs = sum(1 for key, _ in node.value if key.tag != "tag:yaml.org,2002:merge")
        # Resolves `<<: *anchor` in place: inherited pairs first, then the node's own ones,
        # which may override them (only a repeated *own* key is a mistake).
        self._yaml.flatten_mapping(node)
        first_own = len(node.value) - own_pairs
        result: dict[str, Any] = {}
        own_lines: dict[str, int] = {}
        for index, (key_node, value_node) in enumerate(node.value):
            line = key_node.start_mark.line + 1
            if not isinstance(key_node, yaml.ScalarNode):
                self.problems.append(_Problem(line, loc, "keys must be plain strings"))
                continue
            # The raw text, not the typed value: a model named `1.0` or `on` stays a string.
            key = key_node.value
            if index >= first_own:
                if key in own_lines:
                    message = f"duplicate key (first defined on line {own_lines[key]})"
                    self.problems.append(_Problem(line, (*loc, key), message))
                    continue
                own_lines[key] = line
            self.lines[(*loc, key)] = line
            result[key] = self.convert(value_node, (*loc, key))
        return result

    def _scalar(self, node: yaml.ScalarNode, loc: Loc) -> Any:
        line = node.start_mark.line + 1
        try:
            value = self._yaml.construct_object(node, deep=True)
        except yaml.constructor.ConstructorError as exc:
            self.problems.append(_Problem(line, loc, str(exc.problem)))
            self.failed.add(loc)
            return None
        if not isinstance(value, str):
            return value
        try:
            return _interpolate(value, self.env)
        except _InterpolationError as exc:
            self.problems.append(_Problem(line, loc, str(exc)))
            self.failed.add(loc)
            return value


def _interpolate(text: str, env: Mapping[str, str]) -> str:
    """Expand `${VAR}` and `${VAR:-default}` (default also when VAR is empty, as in sh);
    `$${` stands for a literal `${`."""

    def expand(match: re.Match[str]) -> str:
        if match[0] == "$${":
            return "${"
        body = match["body"]
        if body is None:
            raise _InterpolationError("unterminated '${' (write '$${' for a literal '${')")
        name, has_default, default = body.partition(":-")
        if not _VARIABLE_NAME.fullmatch(name):
            raise _InterpolationError(f"invalid variable reference '${{{body}}}'")
        value = env.get(name)
        if has_default and not value:
            return default
        if value is None:
            raise _InterpolationError(
                f"environment variable {name} is not set (set it, or write '${{{name}:-default}}')"
            )
        return value

    return _REFERENCE.sub(expand, text)


def _line_of(loc: Loc, lines: dict[Loc, int]) -> int:
    """The line of `loc`, or of its closest ancestor written in the file (defaults are not)."""
    while loc not in lines and loc:
        loc = loc[:-1]
    return lines.get(loc, 1)


def _from_pydantic(error: ErrorDetails, lines: dict[Loc, int]) -> _Problem:
    # Keep the loc parts that name real YAML locations; that drops pydantic's internal tags
    # such as `[key]` or union member names.
    path: Loc = ()
    for part in error["loc"]:
        if (*path, part) in lines:
            path = (*path, part)
    line = lines[path]
    kind = error["type"]
    if kind == "missing":
        return _Problem(line, (*path, error["loc"][-1]), "required key is missing")
    if kind == "extra_forbidden":
        return _Problem(line, path, "unknown key" + _suggestion(path))
    template = _MESSAGES.get(kind)
    if template is None:  # our own validators' messages, already written for YAML
        return _Problem(line, path, error["msg"])
    ctx = dict(error.get("ctx", {}))
    if "expected" in ctx:  # pydantic says "'a', 'b' or 'c'"
        ctx["expected"] = ctx["expected"].replace(" or ", ", ")
    # A key is a secret even when misplaced: the message goes to logs and /v1/status.
    shown = "a secret, not shown" if "api_keys" in error["loc"] else _show(error["input"])
    return _Problem(line, path, f"{template.format(**ctx)} (got {shown})")


def _suggestion(path: Loc) -> str:
    """` (did you mean 'x'?)` for an unknown key close to a field of the enclosing section."""
    matches = difflib.get_close_matches(str(path[-1]), _field_names(path[:-1]), n=1)
    return f" (did you mean {matches[0]!r}?)" if matches else ""


def _field_names(section: Loc) -> list[str]:
    """Field names of the config model at `section`, found by walking the schema's types."""
    model: type[BaseModel] = Config
    parts = list(section)
    while parts:
        field = model.model_fields.get(str(parts.pop(0)))
        if field is None:
            return []
        annotation = field.annotation
        if get_origin(annotation) is dict and parts:  # `models.<name>`: skip the name
            annotation = get_args(annotation)[1]
            parts.pop(0)
        # An optional section (`distributed: X | None`): its fields are X's.
        sections = [arg for arg in get_args(annotation) if _is_model(arg)]
        if get_origin(annotation) in (Union, UnionType) and len(sections) == 1:
            annotation = sections[0]
        if not _is_model(annotation):
            return []
        model = annotation
    return list(model.model_fields)


def _is_model(annotation: Any) -> TypeGuard[type[BaseModel]]:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return repr(value)


def _dotted(path: Loc) -> str:
    """`models.smol.aliases[1]`: keys joined by dots, list indexes in brackets."""
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else part
    return text
