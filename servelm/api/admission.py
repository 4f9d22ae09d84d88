"""Admission control of generation requests: how many may wait, for how long, and how long one may run.

The settings (``max_waiting``, ``queue_timeout``, ``request_timeout``) live
on the app's :class:`~servelm.api.serving_base.ServingContext`;
:meth:`GenerationRun.start <servelm.api.generation_run.GenerationRun.start>`
applies them.
"""

from __future__ import annotations

from dataclasses import dataclass

from servelm.api.errors import APIError


@dataclass(frozen=True)
class Admission:
    """Admission control of generation requests (settings ``max_waiting``,
    ``queue_timeout``, ``request_timeout``; None: no limit).

    ``max_waiting``: a new request is refused (429 ``queue_full``) while that
    many engine requests already wait to start. ``queue_timeout``: seconds a
    request may wait for its first output before it is aborted and answered
    429 ``queue_timeout``. ``request_timeout``: seconds a whole request may
    run before it is aborted and answered 408 ``request_timeout`` (an error
    event then ``[DONE]`` once a stream has begun).
    """

    max_waiting: int | None = None
    queue_timeout: float | None = None
    request_timeout: float | None = None


# Retry-After of a 429 for a full queue: engine steps take milliseconds to a
# second, so the queue moves within a second or two; clients back off from there.
QUEUE_RETRY_AFTER_S = 1.0


def sequences_asked(prompts: int, choices: int, max_waiting: int) -> int:
    """The sequences a run of ``prompts`` x ``choices`` waits as; a 400 when they are more than
    ``max_waiting``, since such a run could never be admitted."""
    asks = prompts * choices
    if asks > max_waiting:
        raise APIError(
            f"This request asks for {asks} sequences ({prompts} prompt(s) x {choices} choices), "
            f"more than the server queues at once ({max_waiting}): send fewer prompts or choices per request.",
            status=400,
            param="n" if prompts == 1 else "prompt",
        )
    return asks
