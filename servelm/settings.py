"""Server settings: defaults < YAML config file < ``SERVELM_*`` environment < command-line flags.

Built with pydantic-settings. Flags arrive as init keyword arguments (the
highest priority), the environment is read with the ``SERVELM_`` prefix,
and the YAML file named by ``config`` (flag ``--config`` or
``SERVELM_CONFIG``) comes last. Unknown keys and bad values are errors that
name the setting. Torch-free: the API imports this module.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from servelm.engine.config import EngineConfig

ENV_PREFIX = "SERVELM_"

# Kept in step with servelm.models.registry (a test checks); not imported from
# there so that the API, which imports settings, never pulls in servelm.models.
DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_EMBEDDING_MODEL = "all-minilm-l6-v2"

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


# The shape of rate_limit_storage: a `limits` storage URI. servelm uses the
# asyncio variant of the storage ("async+" is added when missing).
_STORAGE_URI = re.compile(r"^(async\+)?[a-z][a-z0-9+.-]*://", re.IGNORECASE)


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


def _split_list(value: Any) -> Any:
    # Environment variables and flags carry lists comma-separated.
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return value


class _YamlFileSource(InitSettingsSource):
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

    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)

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


class Settings(BaseSettings):
    """Everything ``servelm serve`` can be told, with its default.

    ``engine_config()`` turns the engine fields into an ``EngineConfig``.
    """

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="forbid",
        validate_default=True,
        case_sensitive=False,
    )

    config: Path | None = Field(None, description="YAML config file (flags and environment override it).")

    # models
    model: str = Field(DEFAULT_MODEL, description="Chat/completions model: a bundled name or a path.")
    embedding_model: str | None = Field(
        DEFAULT_EMBEDDING_MODEL, description="Embedding model: a bundled name, a path, or none."
    )
    served_model_name: str | None = Field(None, description="Name clients use for the chat model.")
    chat_template: Path | None = Field(None, description="Jinja chat template file overriding the model's own.")

    # engine
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = Field("auto", pattern=r"^(auto|cpu|mps|cuda(:\d+)?)$")
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_model_len: int | None = Field(None, ge=1)
    kv_cache_memory: int | float = Field(1 << 30, description="KV cache size: bytes, or a fraction of free memory.")
    block_size: int = 16
    enable_prefix_caching: bool = True
    seed: int = 0
    quantization: Literal["none", "int8"] = Field(
        "none",
        description=(
            "Weight quantization: none, or int8 (weight-only, CPU; faster decoding of one sequence than "
            "float32 and bfloat16, slower than bfloat16 with many sequences on AVX512-BF16 CPUs; more memory)."
        ),
    )

    # HTTP
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)
    metrics_require_auth: bool = False
    cors_origins: Annotated[list[str], NoDecode] = Field(default_factory=list)
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1)
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    log_format: Literal["text", "json"] = Field("text", description="Log lines as text or as JSON objects.")

    # admission control; 0 or null: no limit
    max_waiting: int | None = Field(
        256, ge=0, description="Most requests waiting to start in the engine; past it new requests get 429."
    )
    queue_timeout: float | None = Field(
        60.0, ge=0, description="Seconds a request may wait to start before it is aborted with 429."
    )
    request_timeout: float | None = Field(
        None, ge=0, description="Seconds a request may run before it is aborted with a timeout error."
    )
    shutdown_timeout: float = Field(
        30.0, ge=0, description="On SIGTERM or Ctrl-C: seconds requests in flight get to finish before they are aborted."
    )

    # scale-out on Ray Serve: any of replicas, ray_address, min/max_replicas turns it on
    replicas: int | None = Field(
        None, ge=1, description="Engine replicas on Ray Serve (a local Ray cluster unless ray_address is set)."
    )
    ray_address: str | None = Field(
        None, description="Join the Ray cluster at HOST:PORT (or auto) instead of starting one here."
    )
    replica_cpus: float = Field(1.0, ge=0, description="CPUs Ray reserves for each replica.")
    replica_gpus: float = Field(0.0, ge=0, description="GPUs Ray reserves for each replica.")
    min_replicas: int | None = Field(None, ge=1, description="Autoscaling: fewest replicas.")
    max_replicas: int | None = Field(None, ge=1, description="Autoscaling: most replicas.")
    target_ongoing_requests: float = Field(
        16.0, gt=0, description="Autoscaling: requests in flight per replica that Serve aims for."
    )
    prefix_routing: bool = Field(
        True, description="Send requests sharing a prompt prefix to the replica that has it cached (load permitting)."
    )
    ray_app_name: str = Field(
        "servelm", pattern=r"^[A-Za-z0-9_.-]+$", description="Name of the Serve application (one per server)."
    )

    # rate limits
    rate_limits: RateLimits = Field(default_factory=RateLimits)
    rate_limit_storage: str = Field(
        "memory://", description="Where rate-limit counters live: a `limits` storage URI (memory://, redis://...)."
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        init_kwargs = getattr(init_settings, "init_kwargs", {})
        return (init_settings, env_settings, _YamlFileSource(settings_cls, init_kwargs))

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _parse_memory(cls, value: Any) -> Any:
        return parse_memory(value)

    @field_validator("api_keys", "cors_origins", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        return _split_list(value)

    @field_validator("api_keys")
    @classmethod
    def _no_blank_keys(cls, value: list[str]) -> list[str]:
        if any(not key.strip() for key in value):
            raise ValueError("API keys must not be blank")
        return value

    @field_validator("rate_limit_storage")
    @classmethod
    def _known_storage(cls, value: str) -> str:
        # Checked here so a typo or a missing client library stops the server
        # before the models load, not at its first request.
        if not _STORAGE_URI.match(value):
            raise ValueError("expected a storage URI such as memory:// or redis://host:6379")
        uri = async_storage_uri(value)
        if uri.lower().startswith("async+memory:"):
            return value
        import limits.aio.storage  # noqa: F401  (registers the async+ schemes)
        from limits.errors import ConfigurationError
        from limits.storage import storage_from_string

        try:
            storage_from_string(uri)
        except ConfigurationError as exc:
            raise ValueError(str(exc)) from None
        return value

    @model_validator(mode="after")
    def _rate_limit_keys_known(self) -> Settings:
        if self.api_keys:
            unknown = [k for k in self.rate_limits.keys if k not in self.api_keys]
            if unknown:
                # Name the key by its end only: it is a secret.
                raise ValueError(
                    f"rate_limits.keys has a key that is not one of api_keys (ending ...{unknown[0][-4:]})"
                )
        return self

    @field_validator("ray_address", mode="before")
    @classmethod
    def _blank_is_none(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() in ("", "none", "null"):
            return None
        return value

    @model_validator(mode="after")
    def _replica_counts(self) -> Settings:
        low, high = self.min_replicas, self.max_replicas
        if low is not None and high is not None and low > high:
            raise ValueError(f"min_replicas ({low}) must be <= max_replicas ({high})")
        outside = self.replicas is not None and (
            (low is not None and self.replicas < low) or (high is not None and self.replicas > high)
        )
        if outside:
            raise ValueError(
                f"replicas ({self.replicas}) is the initial count with autoscaling and must lie "
                f"between min_replicas and max_replicas"
            )
        return self

    @property
    def use_ray(self) -> bool:
        """True when the engines run as replicas on Ray Serve rather than in this process."""
        return any(v is not None for v in (self.replicas, self.ray_address, self.min_replicas, self.max_replicas))

    @field_validator("max_waiting", "queue_timeout", "request_timeout", mode="before")
    @classmethod
    def _none_is_unlimited(cls, value: Any) -> Any:
        # Flags and environment variables carry "none"/"null" as text.
        if isinstance(value, str) and value.strip().lower() in ("", "none", "null"):
            return None
        return value

    @field_validator("max_waiting", "queue_timeout", "request_timeout")
    @classmethod
    def _zero_is_unlimited(cls, value: float | None) -> float | None:
        # 0 would refuse (or time out) every request, so it means "no limit".
        return None if value == 0 else value

    @field_validator("embedding_model", mode="before")
    @classmethod
    def _none_disables(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() in ("", "none", "null"):
            return None
        return value

    @field_validator("chat_template")
    @classmethod
    def _readable(cls, value: Path | None) -> Path | None:
        if value is not None and not value.expanduser().is_file():
            raise ValueError(f"chat template file {str(value)!r} does not exist")
        return value

    @model_validator(mode="after")
    def _engine_config_valid(self) -> Settings:
        try:
            self.engine_config()
        except ValueError as exc:
            raise ValueError(f"invalid engine setting: {exc}") from None
        return self

    def engine_config(self) -> EngineConfig:
        """The engine's configuration from these settings."""
        return EngineConfig(
            dtype=self.dtype,
            device=self.device,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            kv_cache_memory=self.kv_cache_memory,
            enable_prefix_caching=self.enable_prefix_caching,
            seed=self.seed,
            quantization=self.quantization,
        )

    def read_chat_template(self) -> str | None:
        """The override chat template's text, or None to use each model's own."""
        if self.chat_template is None:
            return None
        return self.chat_template.expanduser().read_text(encoding="utf-8")


def async_storage_uri(uri: str) -> str:
    """``uri`` as the asyncio variant of its `limits` storage (``async+redis://...``)."""
    return uri if uri.lower().startswith("async+") else f"async+{uri}"


def unknown_env_vars(environ: Mapping[str, str] | None = None) -> list[str]:
    """``SERVELM_*`` variables that name no setting (likely typos)."""
    environ = os.environ if environ is None else environ
    known = {f"{ENV_PREFIX}{name}".upper() for name in Settings.model_fields}
    return sorted(k for k in environ if k.upper().startswith(ENV_PREFIX) and k.upper() not in known)
