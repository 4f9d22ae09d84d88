"""Streams that survive a dead replica: resume the request elsewhere from what was sent.

When the replica serving a request dies (SIGKILL, its node lost, its engine
loop dead), the front end sends the request again, to another replica, as
the original prompt followed by the tokens the client already has, with
the same sampling parameters less what was already generated. The outputs
of the new request are rewritten to read as the continuation of the old
one (the original prompt ids, generated-token counts and cumulative
logprobs carry on), so the client sees one continuous stream with no text
missing or repeated. After ``MAX_MIGRATIONS`` the request fails with a 503
``replica_failed`` (an SSE error event mid-stream).

Limits, stated in docs/DEPLOY.md: greedy requests resume exactly; sampled
ones continue with a fresh random state; a request with ``n > 1``, a
structured output (its grammar would restart at the resumed prompt's end) or
tools (the tool-call parser's state is on the dead replica) that has already
produced tokens cannot be resumed and fails; text the dead replica held back
(a possible stop string or an unfinished UTF-8 character at the cut) is lost.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from servelm.connectors.base import ConnectorError
from servelm.connectors.ray_replica import raise_error_item
from servelm.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)

MAX_MIGRATIONS = 3


class ReplicaFailed(Exception):
    """The replica serving a stream is gone; the request may be resumed elsewhere."""


def replica_failed_error(request_id: str, cause: BaseException) -> ConnectorError:
    return ConnectorError(
        f"The request {request_id} lost its engine replica {MAX_MIGRATIONS + 1} times ({cause}); giving up.",
        status=503,
        type="service_unavailable_error",
        code="replica_failed",
    )


@dataclasses.dataclass
class _Progress:
    """What the client has received of one request so far."""

    prompt_token_ids: list[int] | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    cumulative_logprob: float = 0.0
    num_cached_tokens: int = 0
    outputs: int = 0  # outputs delivered (any choice)
    multi_choice: bool = False


def resume_request(request: dict[str, Any], progress: _Progress, attempt: int) -> dict[str, Any]:
    """The request to send after a failure: prompt plus generated tokens, budget reduced."""
    params = request["params"]
    new = dict(request)
    new["request_id"] = f"{request['request_id']}~m{attempt}"
    if not progress.token_ids:
        return new
    stateful = params.structured_outputs is not None or params.tool_call_parser is not None
    if progress.multi_choice or params.best_of > 1 or stateful:
        raise ConnectorError(
            "The engine replica serving this request failed after it had produced output; a request with "
            "n > 1, a structured output or tools cannot be resumed on another replica. Retry the request.",
            status=503,
            type="service_unavailable_error",
            code="replica_failed",
        )
    done = len(progress.token_ids)
    changes: dict[str, Any] = {
        "prompt_logprobs": None,
        "min_tokens": max(params.min_tokens - done, 0),
        "prior_output_token_ids": list(progress.token_ids),  # still output for the penalties
    }
    if params.max_tokens is not None:
        changes["max_tokens"] = max(params.max_tokens - done, 1)
    new["params"] = dataclasses.replace(params, **changes)
    assert progress.prompt_token_ids is not None
    new["prompt"] = list(progress.prompt_token_ids) + progress.token_ids
    return new


def _continue(out: RequestOutput, progress: _Progress, base: _Progress | None) -> RequestOutput:
    """Rewrite an output of a resumed request as part of the original one."""
    if progress.prompt_token_ids is None:
        progress.prompt_token_ids = list(out.prompt_token_ids)
        progress.num_cached_tokens = out.num_cached_tokens
    if base is not None:
        # The resumed request's prompt is the original plus the tokens sent.
        out.prompt_token_ids = base.prompt_token_ids or []
        out.num_cached_tokens = base.num_cached_tokens
        out.num_generated_tokens += len(base.token_ids)
        for c in out.outputs:
            c.cumulative_logprob += base.cumulative_logprob
    else:
        out.prompt_token_ids = progress.prompt_token_ids
    for c in out.outputs:
        if c.index != 0:
            progress.multi_choice = True
        elif not progress.multi_choice:
            progress.token_ids.extend(c.token_ids)
            progress.cumulative_logprob = c.cumulative_logprob
    progress.outputs += 1
    return out


async def resumable_stream(
    request: dict[str, Any],
    open_stream: Callable[[dict[str, Any]], AsyncIterator[Any]],
    is_failure: Callable[[BaseException], bool],
    max_migrations: int = MAX_MIGRATIONS,
) -> AsyncIterator[RequestOutput]:
    """Outputs of ``request``, resumed on another replica when the one serving it fails.

    ``open_stream(request)`` yields the replica's items (lists of outputs,
    or an error item); ``is_failure(exc)`` says whether an exception means
    the replica is gone (as opposed to an error of the request itself).
    """
    progress = _Progress()
    base: _Progress | None = None  # what the original request had produced when last resumed
    attempt_request = request
    migrations = 0
    while True:
        try:
            async for item in open_stream(attempt_request):
                if isinstance(item, dict):
                    error = item.get("error", {})
                    if error.get("code") == "engine_dead":
                        raise ReplicaFailed(error.get("message"))
                    raise_error_item(item)
                    continue
                for out in item:
                    out = _continue(out, progress, base)
                    yield out
                    if out.finished:
                        return
            return
        except ConnectorError:
            raise
        except Exception as exc:
            if not isinstance(exc, ReplicaFailed) and not is_failure(exc):
                raise
            migrations += 1
            if migrations > max_migrations:
                raise replica_failed_error(request["request_id"], exc) from None
            logger.warning(
                "request %s: its replica failed (%s); resuming on another replica after %d tokens (migration %d)",
                request["request_id"],
                exc,
                len(progress.token_ids),
                migrations,
            )
            if progress.token_ids:
                base = dataclasses.replace(progress, token_ids=list(progress.token_ids))
            attempt_request = resume_request(request, base or progress, migrations)
