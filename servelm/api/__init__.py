"""The OpenAI-compatible HTTP layer. Imports no torch: it talks to engines only
through the Connector protocol (``servelm.connectors.base``)."""

from servelm.api.app import create_app

__all__ = ["create_app"]
