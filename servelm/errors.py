"""The one error type that carries OpenAI's error fields, shared by the API and the connectors.

The API turns it into OpenAI's envelope ``{"error": {"message", "type",
"param", "code"}}`` with its HTTP status; connectors raise it (as
:class:`servelm.connectors.base.ConnectorError`) for what a client must
hear, such as an unknown model or a prompt that does not fit. Neither side
imports the other's stack: this module imports nothing.
"""

from __future__ import annotations


def default_error_type(status: int) -> str:
    """OpenAI's error ``type`` for a status code."""
    if status == 503:
        return "service_unavailable_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


class APIError(Exception):
    """An error with an HTTP status that the API reports in OpenAI's envelope.

    ``type`` defaults to OpenAI's type for ``status``; ``headers`` go on the
    response (e.g. Retry-After).
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type or default_error_type(status)
        self.param = param
        self.code = code
        self.headers = headers
