"""The browser pages (chat at ``/``, live status at ``/status``): static files, no build step."""

from pathlib import Path

STATIC_DIR = Path(__file__).parent / "static"
