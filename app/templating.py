"""Jinja2 pages with the security headers every HTML response carries (SECURITY.md H2)."""

from __future__ import annotations

from typing import Any

from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup
from starlette.requests import Request
from starlette.responses import HTMLResponse

from app.display import display_text
from app.resources import resource_dir


def _shown(value: Any) -> Any:
    """Every `{{ … }}` of a page: text neutralised (app/display.py) before it is escaped; the
    output of macros (already built from neutralised values) as it is."""
    if isinstance(value, str) and not isinstance(value, Markup):
        return display_text(value, limit=None)
    return value


_environment = Environment(
    loader=FileSystemLoader(resource_dir("templates")),
    autoescape=select_autoescape(default=True, default_for_string=True),
    auto_reload=False,
    finalize=_shown,
)


def html_security_headers() -> dict[str, str]:
    return {
        "Content-Security-Policy": (
            "default-src 'none'; style-src 'self'; img-src 'self'; "
            "form-action 'self'; frame-ancestors 'none'; base-uri 'none'; "
            "object-src 'none'"
        ),
        "X-Frame-Options": "DENY",
        "Referrer-Policy": "no-referrer",
        "X-Content-Type-Options": "nosniff",
        "Cross-Origin-Opener-Policy": "same-origin",
        "Cache-Control": "no-store",
        "Strict-Transport-Security": "max-age=31536000",
    }


def is_development(request: Request) -> bool:
    """Whether the page is served by the `dev` playground (base.html then shows its banner)."""
    app = request.scope.get("app")
    return bool(getattr(getattr(app, "state", None), "development", False))


def render(
    request: Request,
    name: str,
    *,
    status_code: int = 200,
    **context: Any,
) -> HTMLResponse:
    """Render `templates/<name>` with plain values (never ORM rows or secrets)."""
    template = _environment.get_template(name)
    body = template.render(
        request_id=getattr(request.state, "request_id", ""),
        stylesheet="/static/broker.css",
        development=is_development(request),
        **context,
    )
    return HTMLResponse(body, status_code=status_code, headers=html_security_headers())
