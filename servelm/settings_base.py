"""The pieces the settings model is built from: the ``setting()`` field helper and its groups, value
parsers, the YAML file source and the rate-limit models. Torch-free: the API imports them."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import BaseSettings, InitSettingsSource

ENV_PREFIX = "SERVELM_"

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


# The shape of rate_limit_storage: a `limits` storage URI. servelm uses the
# asyncio variant of the storage ("async+" is added when missing).
STORAGE_URI = re.compile(r"^(async\+)?[a-z][a-z0-9+.-]*://", re.IGNORECASE)


class SettingsError(ValueError):
    """A settings problem that is not a field's value: a missing or malformed config file."""


def parse_memory(value: Any) -> Any:
    """``kv_cache_memory``: bytes (``1073741824``, ``4GiB``, ``512MB``) or a fraction (``0.5``)."""
    if isinstance(value, bool) or not isinstance(value, str):
        return value
    text = value.strip()
    try:
        number = float(text)
    except ValueError:
        match = _SIZE.match(text)
        if match is None:
            raise ValueError(f"expected bytes (e.g. 1073741824, 4GiB) or a fraction in (0, 1], got {value!r}") from None
        number_text, unit = match.group(1), (match.group(2) or "").lower()
        base = 1024 if "i" in unit else 1000
        scale = base ** " kmgt".index(unit[0]) if unit and unit[0] in "kmgt" else 1
        return int(float(number_text) * scale)
    if "." in text or "e" in text.lower():
        return number
    return int(text)


def none_text(value: Any) -> Any:
    """Flags and environment variables carry "no value" as text: "", "none" or "null" mean None."""
    if isinstance(value, str) and value.strip().lower() in ("", "none", "null"):
        return None
    return value


def split_list(value: Any) -> Any:
    # Environment variables and flags carry lists comma-separated.
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return value


class YamlFileSource(InitSettingsSource):
    """Settings from the YAML file named by ``config`` in the flags or the environment."""

    def __init__(self, settings_cls: type[BaseSettings], init_kwargs: Mapping[str, Any]):
        path = init_kwargs.get("config") or os.environ.get(f"{ENV_PREFIX}CONFIG")
        data: dict[str, Any] = {}
        if path:
            file = Path(path).expanduser()
            if not file.is_file():
                raise SettingsError(f"config file {str(path)!r} does not exist")
            try:
                loaded = yaml.safe_load(file.read_text(encoding="utf-8"))
            except (OSError, yaml.YAMLError) as exc:
                raise SettingsError(f"config file {str(path)!r} could not be read: {exc}") from None
            if loaded is None:
                loaded = {}
            if not isinstance(loaded, dict):
                raise SettingsError(f"config file {str(path)!r} must hold a mapping of setting: value")
            data = {str(k): v for k, v in loaded.items()}
        super().__init__(settings_cls, data)


class RateLimit(BaseModel):
    """One identity's limits per minute; ``None`` is unlimited.

    In ``rate_limits.keys`` a field left out inherits the default's value,
    while an explicit ``null`` makes that dimension unlimited for the key.
    """

    model_config = ConfigDict(extra="forbid")

    requests_per_minute: int | None = Field(None, ge=1, description="requests per minute")
    tokens_per_minute: int | None = Field(
        None, ge=1, description="tokens per minute: prompt plus max_tokens reserved, corrected to actual use"
    )

    @property
    def unlimited(self) -> bool:
        """True when neither requests nor tokens are limited."""
        return self.requests_per_minute is None and self.tokens_per_minute is None


class RateLimits(BaseModel):
    """Rate limits: a default for every client and overrides per API key.

    A client is its API key when keys are configured, else its address;
    ``keys`` is looked up by that identity.
    """

    model_config = ConfigDict(extra="forbid")

    default: RateLimit = Field(default_factory=RateLimit)
    keys: dict[str, RateLimit] = Field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        """True when any identity has a limit."""
        return not self.default.unlimited or any(not self.for_identity(k).unlimited for k in self.keys)

    def for_identity(self, identity: str) -> RateLimit:
        """The limits of ``identity``: its override's fields over the default's."""
        override = self.keys.get(identity)
        if override is None:
            return self.default
        return self.default.model_copy(update={name: getattr(override, name) for name in override.model_fields_set})


# The groups of settings, in the order --help, servelm.yaml and docs/DEPLOY.md show them,
# each with the line that introduces it.
GROUPS: dict[str, str] = {
    "models": "What to serve.",
    "engine": "The serving engine.",
    "speculative decoding": "Propose several tokens per step and verify them in one batched model call: faster "
    "one-stream decoding where the output is predictable (greedy output is unchanged, sampled output keeps its "
    'distribution). Off by default; a request can turn it off with "speculative_decoding": false.',
    "HTTP": "The HTTP server, auth and logs.",
    "admission control": "Bound the engine's queue and each request's time; 0 or none/null: no limit.",
    "rate limits": "Per API key (per client address when no keys are set). Off by default.",
    "scale-out on Ray Serve": "Run the engines as replicas of a Ray Serve deployment, on this machine or a Ray "
    "cluster (docs/DEPLOY.md). Any of replicas, ray_address, min_replicas, max_replicas turns it on; without "
    "them the engine runs in this process and Ray is never loaded. Every endpoint, metric and limit behaves as "
    "with one engine; max_waiting counts the whole cluster's queue.",
}


def setting(
    default: Any,
    help: str,
    *,
    group: str,
    flag: str | None = None,
    metavar: str | None = None,
    default_text: str | None = None,
    **constraints: Any,
) -> Any:
    """A settings field described once: its help text feeds ``--help``, servelm.yaml and docs/DEPLOY.md.

    ``default`` may be a type or function (a default factory). ``flag`` names
    the command-line flag when it is not ``--<name-with-dashes>`` (``""``: no
    flag); ``default_text`` says what a default of ``None`` or ``[]`` means.
    """
    extra = {"group": group, "flag": flag, "metavar": metavar, "default_text": default_text}
    if callable(default):
        return Field(default_factory=default, description=help, json_schema_extra=extra, **constraints)
    return Field(default, description=help, json_schema_extra=extra, **constraints)


def async_storage_uri(uri: str) -> str:
    """``uri`` as the asyncio variant of its `limits` storage (``async+redis://...``)."""
    return uri if uri.lower().startswith("async+") else f"async+{uri}"
