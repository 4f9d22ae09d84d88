"""The error of an invalid request parameter, shared by sampling and structured-output params."""

from __future__ import annotations


class SamplingParamsError(ValueError):
    """An invalid sampling parameter. ``param`` names the offending field; ``code`` is the API's error code."""

    code: str | None = None

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
