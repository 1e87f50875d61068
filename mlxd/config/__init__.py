"""The YAML config: `load_config(path)` → a validated, immutable `Config`."""

from mlxd.config.loader import load_config, parse_config
from mlxd.config.model import SERVES, TEXT_KINDS, ModelConfig
from mlxd.config.schema import Config
from mlxd.config.sections import (
    AudioConfig,
    BatchConfig,
    CacheConfig,
    DistributedConfig,
    DraftWeights,
    ParsersConfig,
    SamplingDefaults,
    SpeculativeConfig,
)
from mlxd.config.server import ServerConfig

__all__ = [
    "SERVES",
    "TEXT_KINDS",
    "AudioConfig",
    "BatchConfig",
    "CacheConfig",
    "Config",
    "DistributedConfig",
    "DraftWeights",
    "ModelConfig",
    "ParsersConfig",
    "SamplingDefaults",
    "ServerConfig",
    "SpeculativeConfig",
    "load_config",
    "parse_config",
]
