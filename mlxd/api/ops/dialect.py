"""The operational endpoints (health, status, metrics, admin, OpenAPI, the dashboard): no
generation of their own, errors in the default shape."""

from __future__ import annotations

from mlxd.api.common.dialect import Dialect, Route
from mlxd.api.ops import admin, dashboard, openapi

ROUTES = (
    Route("get", "/health", "Liveness and readiness", "operations"),
    Route("get", "/v1/status", "Models, queues, throughput, cache, config", "operations"),
    Route("get", "/metrics", "Prometheus metrics", "operations",
          content_type="text/plain"),
    Route("post", "/admin/reload", "Re-read the config file", "operations"),
    Route("post", "/admin/models/{model}/load", "Load a declared model now", "operations"),
    Route("post", "/admin/models/{model}/unload", "Unload a model now", "operations"),
    Route("get", "/openapi.json", "This document", "operations"),
    Route("get", "/", "Web dashboard (also a liveness page)", "dashboard",
          content_type="text/html"),
    Route("get", "/dashboard/static/{filename}", "Dashboard script, style", "dashboard",
          content_type="text/plain"),
    Route("get", "/dashboard/api/state", "Dashboard state: status, history, request log",
          "dashboard"),
    Route("get", "/dashboard/api/events", "Dashboard state every 2 s (server-sent events)",
          "dashboard", content_type="text/event-stream"),

)  # fmt: skip

DIALECT = Dialect("ops", (admin.blueprint, openapi.blueprint, dashboard.blueprint), routes=ROUTES)
