"""Server settings: defaults < YAML config file < ``SERVELM_*`` environment < command-line flags.

Built with pydantic-settings. Flags arrive as init keyword arguments (the
highest priority), the environment is read with the ``SERVELM_`` prefix,
and the YAML file named by ``config`` (flag ``--config`` or
``SERVELM_CONFIG``) comes last. Unknown keys and bad values are errors that
name the setting. Torch-free: the API imports this module.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from servelm.settings_base import (
    ENV_PREFIX,
    GROUPS,
    STORAGE_URI,
    RateLimit,
    RateLimits,
    SettingsError,
    YamlFileSource,
    async_storage_uri,
    none_text,
    parse_memory,
    setting,
    split_list,
)
from servelm.settings_engine import EngineSettings

__all__ = [
    "ENV_PREFIX",
    "GROUPS",
    "RateLimit",
    "RateLimits",
    "Settings",
    "SettingsError",
    "async_storage_uri",
    "parse_memory",
    "setting",
    "unknown_env_vars",
]

# Kept in step with servelm.models.registry (a test checks); not imported from
# there so that the API, which imports settings, never pulls in servelm.models.
DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_EMBEDDING_MODEL = "all-minilm-l6-v2"


class Settings(EngineSettings, BaseSettings):
    """Everything ``servelm serve`` can be told, with its default.

    The engine's settings (and ``engine_config()``) come from :class:`EngineSettings`.
    """

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="forbid",
        validate_default=True,
        case_sensitive=False,
    )

    config: Path | None = setting(
        None,
        "YAML config file (see servelm.yaml); flags and environment variables override it",
        group="",
        metavar="FILE",
    )

    model: str = setting(
        DEFAULT_MODEL,
        "chat/completions model: a bundled name (smollm2-135m-instruct), a Hugging Face model folder or a GGUF file",
        group="models",
        metavar="NAME_OR_PATH",
    )
    embedding_model: str | None = setting(
        DEFAULT_EMBEDDING_MODEL,
        "model behind /v1/embeddings: a bundled name (all-minilm-l6-v2), a folder, or none to serve no embeddings",
        group="models",
        metavar="NAME_OR_PATH",
    )
    served_model_name: str | None = setting(
        None,
        "the name clients send as 'model' for the chat model",
        group="models",
        metavar="NAME",
        default_text="--model as given",
    )
    chat_template: Path | None = setting(
        None,
        "Jinja chat template file overriding the model's own, read once at start-up",
        group="models",
        metavar="FILE",
        default_text="each model's own template",
    )
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral"] = setting(
        "auto",
        "tool-call format the chat model writes (tools in chat completions): hermes (<tool_call>{...}</tool_call>; "
        "Qwen, Hermes, ChatML models), llama3_json (Llama 3.x JSON calls) or mistral ([TOOL_CALLS][...]); "
        "auto: the one its chat template implies, hermes when it implies none",
        group="models",
    )

    host: str = setting("127.0.0.1", "address to listen on", group="HTTP", metavar="HOST")
    port: int = setting(8000, "port to listen on, 0 for any free port", group="HTTP", metavar="PORT", ge=0, le=65535)
    api_keys: Annotated[list[str], NoDecode] = setting(
        list,
        "API keys: when any is set, every route but /health, /ping and the web pages needs "
        "'Authorization: Bearer KEY' (repeatable flag; comma-separated in SERVELM_API_KEYS)",
        group="HTTP",
        flag="--api-key",
        metavar="KEY",
        default_text="no auth",
    )
    metrics_require_auth: bool = setting(False, "require the API key on /metrics too", group="HTTP")
    web: bool = setting(
        True,
        "serve the chat page at / and the live status page at /status (the pages are public; "
        "the API calls they make need the key when auth is on)",
        group="HTTP",
    )
    cors_origins: Annotated[list[str], NoDecode] = setting(
        list,
        "origins allowed to call the API from a browser (CORS), or '*' (repeatable flag)",
        group="HTTP",
        flag="--cors-origin",
        metavar="ORIGIN",
        default_text="CORS off",
    )
    max_body_bytes: int = setting(
        8 * 1024 * 1024, "largest request body accepted; a larger one gets 413", group="HTTP", metavar="N", ge=1
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = setting(
        "info", "server log level", group="HTTP"
    )
    log_format: Literal["text", "json"] = setting(
        "text",
        "log lines as text or as one JSON object each; access lines (logger servelm.access) carry request id, "
        "client, method, path, route, status, prompt and completion tokens, TTFT and total time",
        group="HTTP",
    )

    max_waiting: int | None = setting(
        256,
        "most sequences waiting to start in the engine (a request waits as its prompts × `n`); a new "
        "chat/completions request that would go past it gets 429 server_overloaded (code queue_full) with "
        "Retry-After, and one that asks for more sequences than this on its own gets 400",
        group="admission control",
        metavar="N",
        ge=0,
    )
    queue_timeout: float | None = setting(
        60.0,
        "seconds a request may wait to start (no first output yet) before it is aborted with the same 429 "
        "(code queue_timeout)",
        group="admission control",
        metavar="SECONDS",
        ge=0,
    )
    request_timeout: float | None = setting(
        None,
        "seconds a request may run in all before it is aborted and answered 408 timeout_error "
        "(code request_timeout); a stream already under way gets an error event, then [DONE]",
        group="admission control",
        metavar="SECONDS",
        default_text="no limit",
        ge=0,
    )
    shutdown_timeout: float = setting(
        30.0,
        "on SIGTERM or Ctrl-C: stop admitting (503 server_shutting_down with Retry-After, /ready 503), give "
        "requests in flight this long to finish, abort the rest with an error, exit 0; a second signal stops at once",
        group="admission control",
        metavar="SECONDS",
        ge=0,
    )

    rate_limits: RateLimits = setting(
        RateLimits,
        "requests and tokens per minute for each client (its API key when api_keys are set, else its address) "
        "on /v1/chat/completions, /v1/completions and /v1/embeddings; tokens are the prompt plus max_tokens for "
        "each choice, reserved at admission and corrected to actual use; over a limit: 429 rate_limit_exceeded "
        "with Retry-After. default applies to every client (null: unlimited); keys holds per-key overrides "
        "(a field left out inherits the default, an explicit null is unlimited; with api_keys set, each must be "
        "one of them)",
        group="rate limits",
        flag="",
        default_text="unlimited",
    )
    rate_limit_storage: str = setting(
        "memory://",
        "where the rate-limit counters live: memory:// (this process) or a store shared by several servers, "
        "such as redis://HOST:6379 (needs limits[async-redis])",
        group="rate limits",
        metavar="URI",
    )

    replicas: int | None = setting(
        None,
        "engine replicas on Ray Serve; alone, it starts a Ray cluster inside the server, on 127.0.0.1 (no "
        "`ray start` needed); with min/max_replicas it is the initial count",
        group="scale-out on Ray Serve",
        metavar="N",
        default_text="no Ray: the engine in this process",
        ge=1,
    )
    ray_address: str | None = setting(
        None,
        "join the Ray cluster at HOST:PORT (its head's address, as `ray start --head` prints it) or auto (the "
        "cluster started on this machine); without replicas, attach to the Serve application already running "
        "there (deploying one replica when there is none); an address nothing answers at exits with status 2 "
        "within 30 s",
        group="scale-out on Ray Serve",
        metavar="HOST:PORT",
        default_text="start a cluster here",
    )
    replica_cpus: float = setting(
        1.0,
        "CPUs Ray reserves for each replica (a replica goes to a node that has them)",
        group="scale-out on Ray Serve",
        metavar="N",
        ge=0,
    )
    replica_gpus: float = setting(
        0.0, "GPUs Ray reserves for each replica", group="scale-out on Ray Serve", metavar="N", ge=0
    )
    min_replicas: int | None = setting(
        None,
        "autoscaling: Serve keeps between min_replicas and max_replicas replicas, aiming at "
        "target_ongoing_requests requests in flight per replica",
        group="scale-out on Ray Serve",
        metavar="N",
        default_text="no autoscaling",
        ge=1,
    )
    max_replicas: int | None = setting(
        None,
        "autoscaling: most replicas (see min_replicas)",
        group="scale-out on Ray Serve",
        metavar="N",
        default_text="no autoscaling",
        ge=1,
    )
    target_ongoing_requests: float = setting(
        16.0,
        "autoscaling: requests in flight per replica that Serve aims for",
        group="scale-out on Ray Serve",
        metavar="N",
        gt=0,
    )
    prefix_routing: bool = setting(
        True,
        "send a request to the replica that last served its prompt prefix (64 tokens or more), whose prefix "
        "cache likely holds it, unless that replica has 8 more requests in flight than the least busy one; "
        "off: power of two choices on load alone",
        group="scale-out on Ray Serve",
    )
    ray_app_name: str = setting(
        "servelm",
        "name of the Serve application: one per set of replicas on a cluster",
        group="scale-out on Ray Serve",
        metavar="NAME",
        pattern=r"^[A-Za-z0-9_.-]+$",
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
        return (init_settings, env_settings, YamlFileSource(settings_cls, init_kwargs))

    @field_validator("api_keys", "cors_origins", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        return split_list(value)

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
        if not STORAGE_URI.match(value):
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

    @field_validator("ray_address", "embedding_model", "max_waiting", "queue_timeout", "request_timeout", mode="before")
    @classmethod
    def _none_text(cls, value: Any) -> Any:
        return none_text(value)

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

    @field_validator("max_waiting", "queue_timeout", "request_timeout")
    @classmethod
    def _zero_is_unlimited(cls, value: float | None) -> float | None:
        # 0 would refuse (or time out) every request, so it means "no limit".
        return None if value == 0 else value

    @field_validator("chat_template")
    @classmethod
    def _readable(cls, value: Path | None) -> Path | None:
        if value is not None and not value.expanduser().is_file():
            raise ValueError(f"chat template file {str(value)!r} does not exist")
        return value

    def read_chat_template(self) -> str | None:
        """The override chat template's text, or None to use each model's own."""
        if self.chat_template is None:
            return None
        return self.chat_template.expanduser().read_text(encoding="utf-8")


def unknown_env_vars(environ: Mapping[str, str] | None = None) -> list[str]:
    """``SERVELM_*`` variables that name no setting (likely typos)."""
    environ = os.environ if environ is None else environ
    known = {f"{ENV_PREFIX}{name}".upper() for name in Settings.model_fields}
    return sorted(k for k in environ if k.upper().startswith(ENV_PREFIX) and k.upper() not in known)
