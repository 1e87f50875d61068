"""The operational endpoints (health, status, metrics, admin, OpenAPI, the dashboard): no
generation of their own, errors in the default shape."""

from __future__ import annotations

from mlxd.api.common.dialect import Dialect
from mlxd.api.ops import admin, dashboard, openapi

DIALECT = Dialect("ops", (admin.blueprint, openapi.blueprint, dashboard.blueprint))
