"""Entry point for `uvicorn --factory` (used by `connect-broker serve`, each worker calls it)."""

from fastapi import FastAPI

from app.config import config_path, load_settings, require_serve_ready
from app.main import create_app


def create_served_app() -> FastAPI:
    settings = load_settings(config_path(None))
    require_serve_ready(settings)
    return create_app(settings)
