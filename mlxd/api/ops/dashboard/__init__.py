"""The web dashboard at `/`: a static page (see `static/`) and the JSON and SSE it reads."""

from mlxd.api.ops.dashboard.routes import blueprint, install

__all__ = ["blueprint", "install"]
