"""The base of every request schema: what the HTTP edge accepts before any handler runs.

Three rules hold for every field of every request body, nested ones
included, so no handler has to remember them:

- **Strict types.** A boolean is ``true``/``false`` and an integer is an
  integer: ``"stream": "yes"`` or ``"max_tokens": true`` is a 400, as at
  OpenAI, rather than something pydantic's lax mode quietly converts.
  (A number field still takes an integer: JSON does not tell them apart.)
- **null means the default.** OpenAI marks most optional fields nullable and
  its SDKs send ``null`` for ``None`` (``"n": null``). A ``null`` on a field
  whose type has no ``None`` is dropped before validation, so the field
  takes its default; a required field keeps its ``null`` and gets a 400.
- **Text is Unicode.** JSON can carry a lone UTF-16 surrogate (``"\\ud800"``),
  which no tokenizer, log line or response can encode. Any string holding
  one, anywhere in the body (keys too), is a 400 naming the field.

Unknown fields stay errors (``extra="forbid"``) unless a schema says
otherwise. Token id prompts get their range checked here too, with a message
that names the bad item.
"""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

# The error type a lone surrogate raises; errors.py names the field from its context.
SURROGATE_ERROR = "string_unpaired_surrogate"

# Bounded so a huge id is a 400 here rather than an overflow in the engine;
# the engine still checks ids against its vocabulary.
MAX_TOKEN_ID = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
TokenIds = list[TokenId]


def check_token_id_lists(value: Any) -> Any:
    """A clear error for a token id prompt with an id out of range.

    Without it a union of string and token-list forms reports the first
    member's complaint ("should be a valid string") for ``[-1]``.
    """
    if not isinstance(value, list):
        return value
    rows = value if value and all(isinstance(v, list) for v in value) else [value]
    for r, row in enumerate(rows):
        for c, tok in enumerate(row):
            if isinstance(tok, int) and not isinstance(tok, bool) and not 0 <= tok <= MAX_TOKEN_ID:
                where = f"[{r}][{c}]" if rows is value else f"[{c}]"
                raise ValueError(f"token ids must be integers in [0, {MAX_TOKEN_ID}]; item {where} is {tok}")
    return value


def _allows_none(annotation: Any) -> bool:
    """True when ``annotation`` accepts None (``X | None``, ``Optional[X]``, ``Any``)."""
    if annotation is Any or annotation is None or annotation is type(None):
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _allows_none(typing.get_args(annotation)[0])
    if origin is typing.Union or origin is types.UnionType:
        return any(_allows_none(arg) for arg in typing.get_args(annotation))
    return False


def _has_surrogate(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


# Types that hold no text: a list of only these (a token id prompt) is skipped whole.
_NO_TEXT = frozenset({int, float, bool, type(None)})


def _any_surrogate(value: Any) -> bool:
    """Whether any string (or key) in ``value`` holds a lone surrogate: the fast check, no paths built.

    It runs on the event loop for every request, so it stays cheap on big
    bodies: a long string costs one ``isascii`` (C), and a list of numbers
    (a million token ids) is cleared by one pass over its element types (C).
    """
    stack = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is str:
            if _has_surrogate(item):
                return True
        elif kind is dict:
            stack.extend(item)
            stack.extend(item.values())
        elif kind is list and not set(map(type, item)) <= _NO_TEXT:
            stack.extend(item)
    return False


def find_surrogate(value: Any, path: str = "") -> str | None:
    """The JSON path (``messages[0].content``) of the first string in ``value`` holding a lone surrogate."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if _has_surrogate(item):
                return where
        elif isinstance(item, dict):
            entries = []
            for key, sub in item.items():
                name = f"{where}.{key}" if where else str(key)
                if isinstance(key, str) and _has_surrogate(key):
                    return where  # the key cannot be printed: name the object holding it
                entries.append((sub, name))
            stack.extend(reversed(entries))
        elif isinstance(item, list):
            stack.extend(reversed([(sub, f"{where}[{i}]") for i, sub in enumerate(item)]))
    return None


class RequestModel(BaseModel):
    """Base of request schemas: strict types, ``null`` as the default, no lone surrogates."""

    model_config = ConfigDict(extra="forbid", strict=True)

    # Fields with a default whose type has no None: a null there is dropped (set per subclass).
    NULL_MEANS_DEFAULT: ClassVar[frozenset[str]] = frozenset()
    # Whether this model scans its input for lone surrogates. Schemas that only
    # ever sit inside a request body turn it off: the body's scan covers them.
    SCAN_TEXT: ClassVar[bool] = True

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        cls.NULL_MEANS_DEFAULT = frozenset(
            name
            for name, info in cls.model_fields.items()
            if not info.is_required() and not _allows_none(info.annotation)
        )

    @model_validator(mode="before")
    @classmethod
    def _at_the_edge(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        drop = cls.NULL_MEANS_DEFAULT
        if drop and any(data.get(name, 0) is None for name in drop):
            data = {k: v for k, v in data.items() if not (v is None and k in drop)}
        where = find_surrogate(data) if cls.SCAN_TEXT and _any_surrogate(data) else None
        if where is not None:
            raise PydanticCustomError(
                SURROGATE_ERROR,
                "The string holds a lone UTF-16 surrogate, which is not valid Unicode text.",
                {"field": where},
            )
        return data
