"""What crosses to a worker process (and from a distributed model's rank 0 to the other ranks'
machines) carries no API key: workers never check keys, the daemon does."""

from __future__ import annotations

import pickle
import textwrap

from mlxd.config import parse_config
from mlxd.runtime.wire import WorkerSpec

YAML = textwrap.dedent(
    """
    server:
      api_keys: [server-s3cret]
    models:
      smol:
        source: /models/smol
        api_keys: [model-s3cret]
        batch: {max_batch_size: 4}
    """
)


def test_worker_spec_carries_no_keys_and_everything_else() -> None:
    config = parse_config(YAML, "models.yaml")
    model = config.models["smol"]
    spec = WorkerSpec.without_keys("smol", model, config.server)
    sent = pickle.dumps(spec)
    assert b"s3cret" not in sent
    assert spec.config.api_keys == [] and spec.server.api_keys == []
    assert spec.config.model_copy(update={"api_keys": model.api_keys}) == model
    assert spec.server.model_copy(update={"api_keys": config.server.api_keys}) == config.server
