"""What every handler shares: the connector context, model lookup, chat rendering,
sampling parameters and cancelling work when the client goes away."""

from __future__ import annotations

import asyncio
import hashlib
import importlib.metadata
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request

from servelm.api.admission import Admission
from servelm.api.errors import (
    UNAVAILABLE_RETRY_AFTER_S,
    APIError,
    ClientDisconnected,
    ServerShuttingDown,
    api_error_from,
    json_value,
    with_param_renamed,
)
from servelm.api.lifecycle import Lifecycle
from servelm.api.metrics import Metrics
from servelm.api.protocol import ChatMessage, SamplingFields
from servelm.connectors.base import Connector, ModelCard, ModelNotFound
from servelm.engine.sampling_params import SamplingParams, SamplingParamsError
from servelm.engine.structured_outputs import StructuredOutputsParams

T = TypeVar("T")

# Names apply_chat_template takes itself; chat_template_kwargs may not shadow them.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"model", "messages", "add_generation_prompt", "chat_template", "tools", "tool_call_parser"}
)


def servelm_version() -> str:
    """The installed package's version."""
    try:
        return importlib.metadata.version("servelm")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0+unknown"


@dataclass
class ServingContext:
    """The per-app state handlers need. Built once by ``create_app``."""

    connector: Connector
    metrics: Metrics
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    admission: Admission = field(default_factory=Admission)
    chat_template: str | None = None
    tool_call_parser: str = "auto"  # --tool-call-parser: a format name, or auto (each model's template's)
    clock: Callable[[], float] = time.time
    new_id: Callable[[], str] = lambda: uuid.uuid4().hex
    version: str = "0.0.0+unknown"


async def not_ready_error(connector: Connector) -> APIError:
    """The 503 for a connector that is not healthy: still loading (``model_not_ready``,
    with Retry-After) or down for good (``engine_dead``)."""
    fatal = await connector.fatal_error()
    if fatal is not None:
        # Why is for the server log (where the server prints it as it exits), not for clients.
        return APIError("The engine is down; the server is exiting.", status=503, code="engine_dead")
    return APIError(
        "The server is not ready: models are still loading. Retry shortly.",
        status=503,
        code="model_not_ready",
        headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)},
    )


class OpenAIServing:
    """Base of the endpoint handlers: model lookup, readiness, chat rendering."""

    def __init__(self, ctx: ServingContext):
        self.ctx = ctx
        self.connector = ctx.connector

    async def require_ready(self) -> None:
        """503 while the server drains, while the connector is still loading, or once its engine is down."""
        if self.ctx.lifecycle.draining:
            self.ctx.metrics.admission_rejections.labels("server_shutting_down").inc()
            raise ServerShuttingDown()
        if not await self.connector.health():
            raise await not_ready_error(self.connector)

    async def model_card(self, name: str | None, kind: str | None) -> ModelCard:
        """The served model called ``name`` (None: the first of ``kind``).

        404 ``model_not_found`` for an unknown name; 400 when the model
        cannot serve this endpoint (an embedding model asked for chat).
        """
        await self.require_ready()
        cards = await self.connector.models()
        if name is None:
            for card in cards:
                if kind is None or card.kind == kind:
                    return card
            raise APIError("No model is served for this endpoint.", status=404, code="model_not_found", param="model")
        for card in cards:
            if card.id == name:
                if kind is not None and card.kind != kind:
                    what = "text generation" if kind == "generate" else "embeddings"
                    raise APIError(
                        f"The model `{name}` does not support {what}.",
                        status=400,
                        code="model_not_supported",
                        param="model",
                    )
                return card
        raise ModelNotFound(name)

    def fingerprint(self, card: ModelCard) -> str:
        """``system_fingerprint``: changes when the server version or the model's source does."""
        digest = hashlib.sha1(f"{self.ctx.version}:{card.id}:{card.root}".encode()).hexdigest()
        return f"fp_{digest[:10]}"

    async def render_chat(
        self,
        model: str,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any] | None,
        tools: list[dict[str, Any]] | None = None,
        tool_call_parser: str | None = None,
    ) -> str:
        """Render messages with the model's chat template (or the --chat-template override).

        ``tools`` (OpenAI definitions) and ``tool_call_parser`` (the model's
        tool-call format) go to the connector's rendering.
        """
        kwargs = dict(chat_template_kwargs or {})
        clash = _RESERVED_TEMPLATE_KWARGS & kwargs.keys()
        if clash:
            name = sorted(clash)[0]
            raise APIError(
                f"chat_template_kwargs may not set '{name}'.", status=400, param=f"chat_template_kwargs.{name}"
            )
        try:
            return await self.connector.apply_chat_template(
                model,
                messages_to_dicts(messages),
                add_generation_prompt=add_generation_prompt,
                chat_template=self.ctx.chat_template,
                tools=tools,
                tool_call_parser=tool_call_parser,
                **kwargs,
            )
        except APIError:
            raise
        except Exception as exc:
            # A template raising (roles not alternating, a missing variable) is
            # about the request's messages, not a server fault.
            raise APIError(f"Could not render the chat template: {exc}", status=400, param="messages") from exc


def messages_to_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Plain dicts for the chat template: text parts joined, ``developer`` as ``system``.

    Templates know ``system``; OpenAI treats ``developer`` as its successor.
    """
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m.audio is not None:
            raise APIError("Audio in messages is not supported.", status=400, param=f"messages[{i}].audio")
        if m.function_call is not None:
            raise APIError(
                "function_call in messages is not supported.", status=400, param=f"messages[{i}].function_call"
            )
        if isinstance(m.content, list):
            texts: list[str] = []
            for j, part in enumerate(m.content):
                if part.type != "text":
                    raise APIError(
                        f"Content parts of type '{part.type}' are not supported; only 'text' is.",
                        status=400,
                        param=f"messages[{i}].content[{j}].type",
                    )
                if part.text is None:
                    raise APIError(
                        "A text content part needs 'text'.", status=400, param=f"messages[{i}].content[{j}].text"
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        elif m.content is None:
            if m.role != "assistant":
                raise APIError(
                    f"Messages with role '{m.role}' need 'content'.", status=400, param=f"messages[{i}].content"
                )
            content = m.refusal or ""
        else:
            content = m.content
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            if m.role != "assistant":
                raise APIError(
                    "Only assistant messages have tool_calls.", status=400, param=f"messages[{i}].tool_calls"
                )
            d["tool_calls"] = [call.model_dump() for call in m.tool_calls]
        if m.role == "tool" and m.tool_call_id is None:
            raise APIError(
                f"Missing required parameter: 'messages[{i}].tool_call_id'.",
                status=400,
                param=f"messages[{i}].tool_call_id",
            )
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def check_supported(req: Any) -> None:
    """400 naming the first field set to something servelm cannot honour."""
    name = req.unsupported_param()
    if name is not None:
        raise APIError(
            f"'{name}' is not supported by servelm (value: {json_value(getattr(req, name))}).", status=400, param=name
        )
    if getattr(req, "stream_options", None) is not None and not getattr(req, "stream", False):
        raise APIError("stream_options can only be set when stream is true.", status=400, param="stream_options")


def sampling_params(
    req: SamplingFields,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    best_of: int | None = None,
    rename: dict[str, str] | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """SamplingParams from a request's sampling fields; unset fields keep the engine's defaults.

    ``rename`` maps SamplingParams names to the request field a client used
    (chat's ``max_completion_tokens``, ``top_logprobs``), so a 400 names it.
    ``structured_outputs`` comes from :func:`servelm.api.structured.structured_request`.
    """
    kwargs: dict[str, Any] = {
        "n": req.n,
        "best_of": best_of,
        "max_tokens": max_tokens,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "stop": [req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        "stop_token_ids": list(req.stop_token_ids or []),
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "min_tokens": req.min_tokens,
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
        "logit_bias": req.logit_bias,
        "seed": req.seed,
        "structured_outputs": structured_outputs,
        "speculative": req.speculative_decoding,
    }
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    try:
        return SamplingParams(**kwargs)
    except SamplingParamsError as exc:
        raise with_param_renamed(api_error_from(exc), rename or {}) from exc


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client disconnects first.

    Cancellation runs the work's cleanup (which aborts the engine request);
    the caller then gets :class:`ClientDisconnected`. Watching ``receive``
    (rather than polling ``is_disconnected``) notices a disconnect at once
    and costs nothing while the client stays.
    """
    task = asyncio.ensure_future(work)

    async def wait_for_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception:
                pass  # the client is gone; nobody to tell
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()
