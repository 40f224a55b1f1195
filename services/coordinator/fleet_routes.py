"""The operator's view: ``GET /v1/fleet`` (JSON) and ``GET /dashboard`` (a live page over it).

Both take the API's credentials when the API has a key. Scripts send ``Authorization: Bearer
<key>``; a browser gets a login prompt (HTTP Basic: any user name, the key as the password) and
then sends those credentials itself with every request of the page, its data polls included.
Basic is accepted here only: these views change nothing, and the API itself wants Bearer, so a
cached dashboard login cannot be used by another site's page to send requests. The
page is plain HTML, CSS and one script, all served from here: it needs no build step and no CDN.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from services.coordinator.errors import unauthorized
from services.coordinator.state import state_of

router = APIRouter()
STATIC = Path(__file__).parent / "static"
ASSET_TYPES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
#: the page and its assets, read once (they ship with the package)
PAGE = (STATIC / "dashboard.html").read_text()
ASSETS = {name: (STATIC / name).read_bytes() for name in ASSET_TYPES}
#: the page loads only its own script and style, and talks only to this server
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
}


@router.get("/v1/fleet", response_model=None)
async def fleet(request: Request, since: float | None = None) -> Response:
    """The fleet now: verifiers, drafters, requests, speed, and the history newer than ``since`` (unix s)."""
    state = state_of(request)
    if not state.authorized(request.headers.get("authorization"), browser=True):
        return unauthorized().response()
    if state.fleet is None:
        return JSONResponse({"error": {"message": "the fleet monitor is not running", "type": "server_error",
                                       "param": None, "code": "fleet_unavailable"}}, status_code=503)
    return JSONResponse(state.fleet.view(since), headers={"Cache-Control": "no-store"})


@router.get("/dashboard", response_model=None)
async def dashboard(request: Request) -> Response:
    if (refused := _login(request)) is not None:
        return refused
    page = PAGE.replace("{{model}}", _escape(state_of(request).model.served_name))
    return Response(page, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)


@router.get("/dashboard/{name}", response_model=None)
async def asset(request: Request, name: str) -> Response:
    if (refused := _login(request)) is not None:
        return refused
    if name not in ASSETS:
        return Response("not found\n", status_code=404, media_type="text/plain")
    return Response(ASSETS[name], media_type=ASSET_TYPES[name], headers=PAGE_HEADERS)


def _login(request: Request) -> Response | None:
    """None when allowed; else 401 asking a browser for the API key (Basic: any user, the key as password)."""
    if state_of(request).authorized(request.headers.get("authorization"), browser=True):
        return None
    return Response("This specfleet dashboard needs the API key: enter any user name and the key as the password.\n",
                    status_code=401, media_type="text/plain",
                    headers={"WWW-Authenticate": 'Basic realm="specfleet", charset="UTF-8"'})


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
