"""What one API key may keep in the daemon's stores (`server.message_batches`,
`server.stored_responses`), and for how long. The open daemon's callers share one quota."""

from __future__ import annotations

from pydantic import Field

from mlxd.config.fields import Section
from mlxd.config.units import ByteSize, Duration

DAY_S = 86400.0


class BatchStoreConfig(Section):
    """Anthropic Message Batches, kept under cache_dir/message-batches/."""

    max_batches: int = Field(
        100,
        ge=1,
        description="Batches one key may keep (ended ones too, until deleted or past "
        "`retention`); creating one more is refused with a 400.",
    )
    max_bytes: ByteSize = Field(
        1024**3,
        description="Disk one key's batches may take (requests and results); once it is "
        "reached, creating another is refused with a 400.",
    )
    expiry: Duration = Field(
        DAY_S,
        gt=0,
        description="A batch still processing this long after its creation ends: what has not "
        "run is reported `expired` (Anthropic's API: 24 hours).",
    )
    retention: Duration = Field(
        29 * DAY_S,
        gt=0,
        description="A batch and its results are deleted this long after its creation "
        "(Anthropic's API: 29 days).",
    )


class ResponseStoreConfig(Section):
    """Stored Responses API answers (`store: true`), kept under cache_dir/responses/ for
    `server.responses_ttl`."""

    max_responses: int = Field(
        10_000,
        ge=1,
        description="Responses one key may keep stored; at the quota a request with "
        "`store: true` is refused with a 400 until some are deleted or expire.",
    )
    max_bytes: ByteSize = Field(
        1024**3,
        description="Disk one key's stored responses may take; once it is reached, a request "
        "with `store: true` is refused with a 400.",
    )
