"""The HTTP API: OpenAI- and Ollama-compatible routes over the ModelManager (see app.create_app)."""

from .app import create_app

__all__ = ["create_app"]
