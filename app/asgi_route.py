"""A Starlette route around an ASGI endpoint object, for the hot paths (app/main.py)."""

from __future__ import annotations

from starlette.routing import Match, Route
from starlette.types import Scope


class AsgiRoute(Route):
    """A route whose endpoint is an ASGI app, taken as it is (Starlette wraps only functions in
    its request/response adapter). Like FastAPI's routes, it leaves itself in the scope
    (`route`), where the access log finds the template requests are counted by."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        # Route's own, named: each request asks every hot route, and `super()` builds an object
        match, child_scope = Route.matches(self, scope)
        if match is not Match.NONE:
            child_scope["route"] = self
        return match, child_scope
