"""The gateway's web console: `GET /console` (ember.webui's gateway page) and the admin-key-protected
data it polls:

    GET /admin/console/series[?since_s=3600]   the last hour's time series (ConsoleSeries)
    GET /admin/console/fleet                   models, deployments and replicas with health and load, and
                                               the autoscaler's counts and decisions from its last report
    PUT /admin/autoscaler                      the autoscaler's report (AutoscalerReport), each round

Keys are managed through the admin API (/admin/keys) and the playground calls /v1/chat/completions
with the user's own API key, so the page adds no mutating route of its own (PUT /admin/autoscaler is
the autoscaler's, with the control token). The admin key travels as
an Authorization header set by the page's script, never as a cookie, so a cross-site form cannot
act with it (no CSRF).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request

from ember.gateway.admin import replica_state, require_admin
from ember.gateway.console.autoscaler_report import AutoscalerReport, LastAutoscalerReport
from ember.gateway.console.series import WINDOW_S
from ember.gateway.dispatch import Dispatcher
from ember.webui import console_router


def fleet_state(dispatcher: Dispatcher, autoscaler: LastAutoscalerReport) -> dict[str, Any]:
    replicas = [replica_state(r) for r in dispatcher.pool.all()]
    replicas += [replica_state(r, draining=True) for r in dispatcher.pool.draining()]
    models = []
    for name, model in dispatcher.config.models.items():
        own = [r for r in replicas if r["model"] == name]
        autoscaling = model.autoscaling
        models.append({
            "name": name,
            "deployments": [d.name for d in model.deployments],
            "replicas": len(own),
            "healthy_replicas": sum(1 for r in own if r["healthy"]),
            "autoscaling": None if autoscaling is None else {
                "min_replicas": autoscaling.min_replicas, "max_replicas": autoscaling.max_replicas,
                "current_replicas": len(own),
                "autoscaler": autoscaler.for_model(name),  # None until the autoscaler reports
            },
        })  # fmt: skip
    return {"object": "console.fleet", "models": models, "replicas": replicas}


def build_console_router(dispatcher: Dispatcher) -> APIRouter:
    def admin_only(request: Request) -> None:
        require_admin(dispatcher, request.headers.get("authorization"))

    router = console_router("gateway.html")
    autoscaler = LastAutoscalerReport()

    @router.get("/admin/console/series", dependencies=[Depends(admin_only)])
    async def series(since_s: float = Query(default=WINDOW_S, gt=0, le=WINDOW_S)) -> dict[str, Any]:
        price = dispatcher.config.metrics.replica_price_per_hour
        return dispatcher.metrics.series.to_json(since_s, price)

    @router.get("/admin/console/fleet", dependencies=[Depends(admin_only)])
    async def fleet() -> dict[str, Any]:
        return fleet_state(dispatcher, autoscaler)

    @router.put("/admin/autoscaler", dependencies=[Depends(admin_only)])
    async def autoscaler_report(report: AutoscalerReport) -> dict[str, Any]:
        autoscaler.store(report)
        return {"object": "autoscaler.report", "received_at": autoscaler.received_at}

    return router
