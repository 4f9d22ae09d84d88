"""The Connector protocol: the only seam between the HTTP API and an engine.

The API layer talks to engines only through this protocol, so it never
imports torch. ``connectors/local.py`` runs the engine in this process;
tests use a fake; a Ray connector can put replicas behind the same calls.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from servelm.engine.outputs import EmbeddingOutput, EngineStats, RequestOutput
from servelm.engine.sampling_params import SamplingParams
from servelm.errors import APIError


class ConnectorError(APIError):
    """An error a connector raises for the client to hear (an unknown model, a prompt that does not fit).

    It carries the fields of OpenAI's envelope as every :class:`APIError` does.
    """


class ModelNotFound(ConnectorError):
    def __init__(self, model: str):
        super().__init__(f"The model `{model}` does not exist.", status=404, code="model_not_found", param="model")


class ContextLengthExceeded(ConnectorError):
    def __init__(self, message: str, param: str | None = "messages"):
        super().__init__(message, status=400, code="context_length_exceeded", param=param)


@dataclass
class ModelCard:
    """What /v1/models shows about one served model."""

    id: str
    kind: str  # "generate" or "embed"
    max_model_len: int
    owned_by: str = "servelm"
    created: int = 0
    root: str | None = None  # the path or bundled name it was loaded from
    # The tool-call format its chat template implies (servelm.engine.tool_parsers); None for embeddings.
    tool_call_parser: str | None = None


@dataclass(frozen=True)
class QueueDepth:
    """How busy the engine is: requests running and requests waiting.

    A request is *waiting* from its submission until the engine starts
    running it; the API's admission control (``max_waiting``) reads
    ``waiting``.
    """

    running: int = 0
    waiting: int = 0


@dataclass(frozen=True)
class ReplicaStatus:
    """One engine replica as ``GET /v1/replicas`` shows it.

    ``state`` is RUNNING, DEAD (its engine loop stopped) or UNRESPONSIVE
    (a Ray replica that stopped reporting: killed, or its node is gone).
    """

    replica: str
    state: str
    node: str
    pid: int
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    node_id: str | None = None
    last_report_s: float = 0.0  # seconds since its last report


@runtime_checkable
class Connector(Protocol):
    """What the API needs from an engine (or a cluster of them).

    Every method is async. Models are looked up by the name a client sends;
    an unknown name raises :class:`ModelNotFound`.
    """

    async def models(self) -> list[ModelCard]: ...

    async def health(self) -> bool:
        """True once every model is loaded and the engine loop is alive."""
        ...

    async def fatal_error(self) -> str | None:
        """Why the connector can never serve again (its engine loop died, its
        models failed to load), or None. The server exits when this is set.
        """
        ...

    def generate(
        self,
        model: str,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (delta mode), the last one with finished=True.

        Raises ConnectorError (e.g. ContextLengthExceeded) before the first
        output when the request cannot be admitted.
        """
        ...

    async def abort(self, model: str, request_id: str) -> None: ...

    async def queue_depth(self) -> QueueDepth:
        """Requests running and waiting in the engine(s), summed over models.

        Called before every generation request, so it must be cheap and
        must not wait on the engine.
        """
        ...

    async def engine_stats(self) -> list[EngineStats]:
        """Each engine's gauges and running totals (for /metrics; empty before loading). Cheap.

        With several replicas: one entry per replica (``replica`` set) and,
        per model, their sum (``replica`` None).
        """
        ...

    async def replicas(self) -> list[ReplicaStatus]:
        """The engine replicas behind this connector and their load (``GET /v1/replicas``). Cheap."""
        ...

    async def embed(self, model: str, inputs: list[str] | list[list[int]]) -> list[EmbeddingOutput]: ...

    async def tokenize(self, model: str, text: str, add_special_tokens: bool = True) -> list[int]: ...

    async def detokenize(self, model: str, token_ids: list[int]) -> str: ...

    async def apply_chat_template(
        self,
        model: str,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_call_parser: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render chat messages to a prompt string with the model's template.

        ``tools`` are OpenAI tool definitions; ``tool_call_parser`` is the
        tool-call format to teach a template that knows nothing of tools
        (see ``Tokenizer.apply_chat_template``).
        """
        ...
