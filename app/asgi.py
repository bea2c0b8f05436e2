"""Entry point for `uvicorn --factory` (used by `connect-broker serve`, each worker calls it)."""

from fastapi import FastAPI

from app.config import load_serve_settings
from app.main import create_app


def create_served_app() -> FastAPI:
    return create_app(load_serve_settings(None))
