"""The interactive API pages, ``/docs`` (Swagger UI) and ``/redoc`` (ReDoc), served with their
scripts and styles from the gateway itself: FastAPI's own pages load them from a CDN, so on a
machine without internet they were blank. The files are those the ``fastapi-offline`` package
ships (Swagger UI 5, which reads the OpenAPI 3.1 that FastAPI writes)."""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.staticfiles import StaticFiles
from starlette.responses import HTMLResponse

ASSETS = "/docs/assets"
FILES = Path(fastapi_offline.__file__).parent / "static"


def add_docs_pages(app: FastAPI, docs: str = "/docs", redoc: str = "/redoc") -> None:
    """``docs`` and ``redoc`` on ``app`` (built with ``docs_url=None, redoc_url=None``), their files
    under ``/docs/assets``; each page's URLs keep the ASGI root path (behind a path-prefix proxy)."""
    app.mount(ASSETS, StaticFiles(directory=FILES), name="docs-assets")
    openapi_url = app.openapi_url or "/openapi.json"
    redirect = app.swagger_ui_oauth2_redirect_url or f"{docs}/oauth2-redirect"

    @app.get(docs, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=f"{root}{openapi_url}",
            title=f"{app.title}: API",
            oauth2_redirect_url=f"{root}{redirect}",
            swagger_js_url=f"{root}{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS}/favicon.png",
        )

    @app.get(redirect, include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get(redoc, include_in_schema=False)
    async def redoc_page(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(
            openapi_url=f"{root}{openapi_url}",
            title=f"{app.title}: API",
            redoc_js_url=f"{root}{ASSETS}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{ASSETS}/favicon.png",
            with_google_fonts=False,
        )
