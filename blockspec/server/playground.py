"""`GET /`: the playground, a chat page that shows each DFlash verify cycle (issue #26).

Plain HTML/CSS/JS shipped in blockspec/server/ui/ (package data; no build step, nothing fetched
from elsewhere). The page talks to the server's own /v1/chat/completions with
`stream_options.include_spec_cycles` and polls /metrics and /health.

The page itself is public, as llama.cpp's server page is: it holds no data and runs nothing.
The API-key rule is the API's, unchanged: with --api-key every call the page makes needs the
key, which the page asks for (on the first 401) and sends as `Authorization: Bearer`.
`blockspec serve --no-ui` leaves these routes out.
"""
from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from blockspec.server.errors import error_body

# The only files served, by name: nothing else under the package can be asked for.
UI_FILES = {"index.html": "text/html; charset=utf-8", "playground.css": "text/css; charset=utf-8",
            "playground.js": "text/javascript; charset=utf-8"}
# The page has no inline script and loads nothing from elsewhere: say so to the browser.
CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")


def ui_file(name: str) -> bytes:
    return resources.files("blockspec.server").joinpath("ui", name).read_bytes()


def file_response(name: str) -> Response:
    # no-cache: after an upgrade the browser revalidates rather than mixing old and new files
    headers = {"Cache-Control": "no-cache", "Content-Security-Policy": CONTENT_SECURITY_POLICY,
               "X-Content-Type-Options": "nosniff"}
    return Response(ui_file(name), media_type=UI_FILES[name], headers=headers)


def add_playground(app: FastAPI) -> None:
    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        return file_response("index.html")

    @app.get("/ui/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in UI_FILES:
            return JSONResponse(error_body(404, f"No playground file '{name}'."), 404)
        return file_response(name)
