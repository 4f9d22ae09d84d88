"""Structured outputs: what a request asks its output to match (a JSON schema, a regex, a grammar, ...).

Torch-free and xgrammar-free, so the API layer builds and checks these
params at the edge, and they pickle to engine replicas unchanged; the
grammar they name is compiled on the engine's side
(:mod:`servelm.engine.grammar_compiler`). Everything that can be checked
without compiling is checked here: exactly one kind, the right types, and
JSON schema keywords the grammar engine would silently not enforce.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

from servelm.engine.params_error import SamplingParamsError

# The kinds, in the order a request's fields are read; each is a field of StructuredOutputsParams.
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")

# Validation keywords xgrammar 0.2.8 accepts but does not enforce: a schema using
# them would produce output that does not validate, so it is refused instead.
UNENFORCED_KEYWORDS = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "contains",
        "minContains",
        "maxContains",
        "$dynamicRef",
        "$dynamicAnchor",
        "$recursiveRef",
        "$recursiveAnchor",
    }
)

# Where a schema holds subschemas: keyword -> how (one schema, a list, or a name -> schema map).
_SUBSCHEMA_ONE = ("additionalProperties", "items", "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_SUBSCHEMA_LIST = ("prefixItems", "anyOf", "oneOf", "allOf", "items")
_SUBSCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions")


class StructuredOutputsError(SamplingParamsError):
    """A structured-output spec that cannot be honoured; ``param`` is ``structured_outputs.<kind>``."""

    code = "invalid_structured_output"


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain a request's output; exactly one field is set.

    - ``json``: a JSON schema (a dict, or its JSON text); the output is one
      JSON value that validates against it.
    - ``json_object``: True for any JSON object.
    - ``regex``: the output matches this regular expression.
    - ``choice``: the output is exactly one of these strings.
    - ``grammar``: an EBNF grammar (xgrammar's dialect, GBNF-like) whose
      ``root`` rule the output matches.
    - ``structural_tag``: an xgrammar structural tag (JSON text), e.g. free
      text until a trigger, then a schema (forced tool calls).

    Construction checks the spec and raises :class:`StructuredOutputsError`.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        chosen = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(chosen) != 1:
            what = "none" if not chosen else " and ".join(chosen)
            raise StructuredOutputsError(
                "structured_outputs", f"structured_outputs needs exactly one of {', '.join(KINDS)}; got {what}"
            )
        self._check(chosen[0])

    @property
    def kind(self) -> str:
        """The field that is set."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The set field's value as text: with :attr:`kind`, the grammar's identity (the cache key)."""
        value = getattr(self, self.kind)
        if self.kind == "json" and not isinstance(value, str):
            # Key order matters to the grammar (properties are generated in order): never sort.
            return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
        if self.kind == "choice":
            return json.dumps(value, ensure_ascii=False)
        return str(value)

    def _check(self, kind: str) -> None:
        param = f"structured_outputs.{kind}"
        value = getattr(self, kind)

        def bad(why: str) -> StructuredOutputsError:
            return StructuredOutputsError(param, f"{param} {why}")

        if kind == "json":
            schema = value
            if isinstance(value, str):
                try:
                    schema = json.loads(value)
                except ValueError as exc:
                    raise bad(f"is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise bad("must be a JSON schema: an object (or true/false)")
            problem = unenforced_keyword(schema)
            if problem is not None:
                raise bad(problem)
        elif kind == "json_object":
            if value is not True:
                raise bad("must be true")
        elif kind == "choice":
            if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) and c for c in value):
                raise bad("must be a non-empty list of non-empty strings")
        elif not isinstance(value, str) or not value.strip():
            raise bad("must be a non-empty string")


def unenforced_keyword(schema: Any) -> str | None:
    """Why ``schema`` cannot be enforced (a keyword the grammar engine ignores, and where), or None."""
    for path, sub in _subschemas(schema, "schema"):
        for keyword in sub:
            if keyword in UNENFORCED_KEYWORDS:
                return f"uses the keyword '{keyword}' (at {path}), which servelm cannot enforce"
        if sub.get("uniqueItems") is True:
            return f"uses 'uniqueItems': true (at {path}), which servelm cannot enforce"
        all_of = sub.get("allOf")
        if isinstance(all_of, list) and len(all_of) > 1:
            return f"uses 'allOf' with {len(all_of)} schemas (at {path}); servelm enforces allOf with one schema only"
        ref = sub.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            return f"refers to '{ref}' (at {path}); only references inside the schema (#/...) are supported"
    return None


def _subschemas(schema: Any, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every object schema within ``schema`` (itself included), with its path, depth first."""
    stack: list[tuple[str, Any]] = [(path, schema)]
    while stack:
        where, sub = stack.pop()
        if not isinstance(sub, dict):
            continue  # true/false, or a malformed value the compiler reports
        yield where, sub
        for key in _SUBSCHEMA_ONE:
            if isinstance(sub.get(key), dict):
                stack.append((f"{where}.{key}", sub[key]))
        for key in _SUBSCHEMA_LIST:
            if isinstance(sub.get(key), list):
                stack.extend((f"{where}.{key}[{i}]", s) for i, s in enumerate(sub[key]))
        for key in _SUBSCHEMA_MAP:
            if isinstance(sub.get(key), dict):
                stack.extend((f"{where}.{key}.{name}", s) for name, s in sub[key].items())
