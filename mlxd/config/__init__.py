"""The YAML config: `load_config(path)` → a validated, immutable `Registry`."""

from mlxd.config.loader import load_config, parse_config
from mlxd.config.model import ModelConfig
from mlxd.config.schema import Registry
from mlxd.config.sections import (
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
    "BatchConfig",
    "CacheConfig",
    "DistributedConfig",
    "DraftWeights",
    "ModelConfig",
    "ParsersConfig",
    "Registry",
    "SamplingDefaults",
    "ServerConfig",
    "SpeculativeConfig",
    "load_config",
    "parse_config",
]
