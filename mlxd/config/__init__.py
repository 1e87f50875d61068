"""The YAML config: `load_config(path)` → a validated, immutable `Registry`."""

from mlxd.config.loader import load_config, parse_config
from mlxd.config.schema import (
    BatchConfig,
    CacheConfig,
    DistributedConfig,
    DraftWeights,
    ModelConfig,
    ParsersConfig,
    Registry,
    SamplingDefaults,
    ServerConfig,
    SpeculativeConfig,
)

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
