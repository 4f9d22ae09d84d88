"""Structured outputs at the HTTP edge: the request fields, and the engine's params made from them.

Three ways to ask for the same thing, each mapped to one
:class:`~servelm.engine.structured_outputs.StructuredOutputsParams`:
OpenAI's ``response_format`` (chat), vLLM's ``structured_outputs`` and
vLLM's older ``guided_*`` fields. A request may set one kind, once; every
error names the field the client used (``response_format.json_schema.schema``,
``structured_outputs.regex``, ``guided_json``), including the errors the
engine raises when it compiles the grammar (see :attr:`StructuredRequest.param_names`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import Field

from servelm.api.errors import APIError, with_param_renamed
from servelm.api.request_model import RequestModel
from servelm.engine.structured_outputs import StructuredOutputsError, StructuredOutputsParams


class JSONSchemaFormat(RequestModel):
    """``response_format.json_schema``: OpenAI's named JSON schema."""

    SCAN_TEXT: ClassVar[bool] = False  # always inside a request body, which scans it

    name: str = Field(description="The schema's name (accepted; not used).")
    description: str | None = Field(None, description="Accepted; not used.")
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="The JSON schema the output follows.")
    strict: bool | None = Field(None, description="Accepted; the output always follows the schema.")


class ResponseFormat(RequestModel):
    """``response_format``: free text, any JSON object, or JSON following a schema."""

    SCAN_TEXT: ClassVar[bool] = False

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = Field(None, description='Required with type "json_schema".')


class StructuredOutputsRequest(RequestModel):
    """vLLM's ``structured_outputs``: exactly one kind of constraint."""

    SCAN_TEXT: ClassVar[bool] = False

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="A JSON schema.")
    regex: str | None = Field(None, description="A regular expression the whole output matches.")
    choice: list[str] | None = Field(None, description="The output is exactly one of these strings.")
    grammar: str | None = Field(
        None, description="An EBNF grammar (xgrammar's dialect); the output matches its root rule."
    )
    json_object: bool | None = Field(None, description="true: any JSON object.")
    structural_tag: str | None = Field(None, description="An xgrammar structural tag, as JSON text.")


# vLLM's older fields, each one kind.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


@dataclass(frozen=True)
class StructuredRequest:
    """A request's structured outputs: the engine's params (None: unconstrained) and the client's field names.

    ``param_names`` maps the engine's names for the spec
    (``structured_outputs.json``, ...) to the field the client set, for
    renaming errors raised later by the engine (a grammar that does not compile).
    """

    params: StructuredOutputsParams | None = None
    param_names: dict[str, str] = field(default_factory=dict)


def structured_request(req: Any) -> StructuredRequest:
    """The structured outputs a chat or completion request asks for; a 400 naming the field when it cannot be honoured."""
    sources = _sources(req)
    if not sources:
        return StructuredRequest()
    if len(sources) > 1:
        (first, _, _), (second, _, _) = sources[:2]
        raise APIError(
            f"Only one structured output may be set; the request sets {first} and {second}.",
            status=400,
            param=second,
            code=StructuredOutputsError.code,
        )
    client_field, kind, value = sources[0]
    names = {"structured_outputs": client_field, f"structured_outputs.{kind}": client_field}
    try:
        params = StructuredOutputsParams(**{kind: value})
    except StructuredOutputsError as exc:
        raise with_param_renamed(APIError(str(exc), status=400, param=exc.param, code=exc.code), names) from None
    return StructuredRequest(params, names)


def _sources(req: Any) -> list[tuple[str, str, Any]]:
    """Each structured output the request sets: (the client's field, the kind, the value)."""
    sources: list[tuple[str, str, Any]] = []
    response_format: ResponseFormat | None = getattr(req, "response_format", None)
    if response_format is not None and response_format.type == "json_object":
        sources.append(("response_format", "json_object", True))
    elif response_format is not None and response_format.type == "json_schema":
        spec = response_format.json_schema
        if spec is None:
            raise APIError(
                "response_format of type \"json_schema\" needs 'json_schema'.",
                status=400,
                param="response_format.json_schema",
            )
        if spec.schema_ is None:
            raise APIError(
                "Missing required parameter: 'response_format.json_schema.schema'.",
                status=400,
                param="response_format.json_schema.schema",
            )
        sources.append(("response_format.json_schema.schema", "json", spec.schema_))
    so: StructuredOutputsRequest | None = req.structured_outputs
    if so is not None:
        kinds = [
            (kind, getattr(so, "json_" if kind == "json" else kind))
            for kind in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
        ]
        kinds = [(kind, value) for kind, value in kinds if value is not None and value is not False]
        if not kinds:
            raise APIError(
                "structured_outputs needs one of json, regex, choice, grammar, json_object, structural_tag.",
                status=400,
                param="structured_outputs",
                code=StructuredOutputsError.code,
            )
        sources += [(f"structured_outputs.{kind}", kind, value) for kind, value in kinds]
    for name, kind in GUIDED_FIELDS.items():
        value = getattr(req, name)
        if value is not None:
            sources.append((name, kind, value))
    return sources
