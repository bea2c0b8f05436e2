"""Annotated dependency aliases for the FastAPI routes (aliases only)."""

from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncSession

from app.db import get_session
from app.runtime import Runtime


async def get_runtime(request: Request) -> Runtime:
    """Async: FastAPI would run a plain function on its thread pool, a hand-off per request."""
    runtime: Runtime = request.app.state.runtime
    return runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]
SessionDep = Annotated[AsyncSession, Depends(get_session, scope="function")]
