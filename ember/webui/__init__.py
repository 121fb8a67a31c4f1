"""The web console's static files, served by the gateway (`gateway.html`) and by `ember serve`
(`serve.html`) at `/console`: plain HTML, CSS and JavaScript in the package, nothing fetched from
elsewhere, so it works offline. The playground (playground.html) is shared by both pages."""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response
from starlette.exceptions import HTTPException

ASSETS = {"console.js": "text/javascript", "gateway.js": "text/javascript", "serve.js": "text/javascript", "style.css": "text/css"}
HEADERS = {
    # Only this origin's scripts and styles; the keys the page holds go nowhere else.
    "content-security-policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "cache-control": "no-store",
}
PLAYGROUND_SLOT = "<!-- playground -->"


def _read(name: str) -> str:
    return files(__name__).joinpath(name).read_text(encoding="utf-8")


def render_page(page: str) -> str:
    return _read(page).replace(PLAYGROUND_SLOT, _read("playground.html"))


def console_router(page: str) -> APIRouter:
    """`GET /console` (the page, `gateway.html` or `serve.html`) and `GET /console/<asset>`."""
    html = render_page(page)
    assets = {name: _read(name) for name in ASSETS}
    router = APIRouter(include_in_schema=False)

    @router.get("/console")
    async def console() -> HTMLResponse:
        return HTMLResponse(html, headers=HEADERS)

    @router.get("/console/{name}")
    async def asset(name: str) -> Response:
        if name not in assets:
            raise HTTPException(404)  # the app's handler answers it in OpenAI's error shape
        return Response(assets[name], media_type=ASSETS[name], headers=HEADERS)

    return router
