"""Entry point for `uvicorn --factory` (used by `connect-broker serve`, each worker calls it)."""

from fastapi import FastAPI

from app.config import load_serve_settings
from app.logsetup import configure_logging
from app.main import create_app


def create_served_app() -> FastAPI:
    settings = load_serve_settings(None)
    # A worker of `serve --workers N` is a new process: the command's logging setup does not
    # reach it. With one worker this finds logging already set up and changes nothing.
    configure_logging(json=settings.logging.format == "json")
    return create_app(settings)
