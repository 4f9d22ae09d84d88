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

from servelm.engine.config import EngineConfig
from servelm.settings_base import (
    ENV_PREFIX,
    GROUPS,
    STORAGE_URI,
    RateLimit,
    RateLimits,
    SettingsError,
    YamlFileSource,
    async_storage_uri,
    parse_memory,
    setting,
    split_list,
)

__all__ = ["ENV_PREFIX", "GROUPS", "RateLimit", "RateLimits", "Settings", "SettingsError", "async_storage_uri",
           "parse_memory", "setting", "unknown_env_vars"]

# Kept in step with servelm.models.registry (a test checks); not imported from
# there so that the API, which imports settings, never pulls in servelm.models.
DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_EMBEDDING_MODEL = "all-minilm-l6-v2"


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

    config: Path | None = setting(
        None, "YAML config file (see servelm.yaml); flags and environment variables override it", group="", metavar="FILE"
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

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = setting(
        "auto",
        "weight and activation dtype; auto: bfloat16 on CUDA and on CPUs whose bfloat16 matmuls are at least "
        "1.5x faster than float32 ones (measured at start-up and logged), else float32",
        group="engine",
    )
    device: str = setting(
        "auto", "cpu, cuda, cuda:N, mps or auto", group="engine", metavar="DEVICE", pattern=r"^(auto|cpu|mps|cuda(:\d+)?)$"
    )
    max_num_seqs: int = setting(64, "most sequences running in one engine step", group="engine", metavar="N", ge=1)
    max_num_batched_tokens: int = setting(
        2048, "token budget of one engine step (prefill chunks + decodes)", group="engine", metavar="N", ge=1
    )
    max_model_len: int | None = setting(
        None, "context length limit", group="engine", metavar="N", default_text="the model's own", ge=1
    )
    kv_cache_memory: int | float = setting(
        1 << 30,
        "paged KV cache size: bytes (1073741824, 4GiB, 512MB) or a fraction in (0, 1] of free device memory "
        "(of available RAM on CPU), e.g. 0.5",
        group="engine",
        metavar="SIZE",
    )
    block_size: int = setting(16, "tokens per KV cache block, a power of two", group="engine", metavar="N")
    enable_prefix_caching: bool = setting(
        True, "reuse the KV cache of shared prompt prefixes", group="engine", flag="--prefix-caching"
    )
    seed: int = setting(
        0, "engine random seed (a request's own seed overrides it for that request)", group="engine", metavar="N"
    )
    quantization: Literal["none", "int8", "w8a8"] = setting(
        "none",
        "weights: none, or int8 weight-only on CPU (per-row scales); int8 decodes one sequence faster than "
        "float32 and bfloat16 and keeps a float copy for large batches, so it uses more memory, not less; "
        "w8a8 (CPU) also quantizes activations per token and multiplies int8 by int8, for prefill and batched "
        "decoding (up to twice bfloat16's rate with AVX512-VNNI; one sequence decodes as with int8); greedy "
        "outputs agree with unquantized ones closely but not exactly (docs/BENCHMARKS.md)",
        group="engine",
    )
    cpu_matmul: Literal["auto", "onednn", "pairs"] = setting(
        "auto",
        "bfloat16 matmuls of decoding steps of up to 64 sequences on CPU: pairs (servelm's small-GEMM kernel, "
        "AVX512-BF16 CPUs), onednn (oneDNN's prepacked GEMM), or auto: the faster in a timing at start-up (logged); "
        "pin it for reproducible runs",
        group="engine",
    )

    speculative_method: Literal["none", "ngram", "draft"] = setting(
        "none",
        "none; ngram: prompt lookup, proposing the tokens that followed the last earlier occurrence of the "
        "text's last few tokens (no second model; pays on tasks that repeat their input: rewriting, "
        "summarizing, extraction, code edits); draft: a smaller model with the same tokenizer "
        "(speculative_model) proposes",
        group="speculative decoding",
    )
    speculative_model: str | None = setting(
        None,
        "the draft model of speculative_method draft: a bundled name, a Hugging Face folder or a GGUF file "
        "whose tokenizer is the served model's; its KV cache shares kv_cache_memory",
        group="speculative decoding",
        metavar="NAME_OR_PATH",
        default_text="none",
    )
    num_speculative_tokens: int = setting(
        4, "tokens proposed per sequence and step", group="speculative decoding", metavar="N", ge=1, le=64
    )
    speculative_ngram_min: int = setting(
        1, "ngram: the shortest tail of the text looked up", group="speculative decoding", metavar="N", ge=1
    )
    speculative_ngram_max: int = setting(
        4, "ngram: the longest tail of the text looked up (the longest match wins)",
        group="speculative decoding", metavar="N", ge=1,
    )
    speculative_max_batch_size: int = setting(
        4,
        "speculate only while at most this many sequences run: a bigger batch is compute-bound, and the "
        "rejected tokens' work would cost more than the steps saved",
        group="speculative decoding",
        metavar="N",
        ge=1,
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
        "most requests waiting to start in the engine; past it a new chat/completions request gets 429 "
        "server_overloaded (code queue_full) with Retry-After",
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
        1.0, "CPUs Ray reserves for each replica (a replica goes to a node that has them)",
        group="scale-out on Ray Serve", metavar="N", ge=0,
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
        None, "autoscaling: most replicas (see min_replicas)", group="scale-out on Ray Serve", metavar="N",
        default_text="no autoscaling", ge=1,
    )
    target_ongoing_requests: float = setting(
        16.0, "autoscaling: requests in flight per replica that Serve aims for",
        group="scale-out on Ray Serve", metavar="N", gt=0,
    )
    prefix_routing: bool = setting(
        True,
        "send a request to the replica that last served its prompt prefix (64 tokens or more), whose prefix "
        "cache likely holds it, unless that replica has 8 more requests in flight than the least busy one; "
        "off: power of two choices on load alone",
        group="scale-out on Ray Serve",
    )
    ray_app_name: str = setting(
        "servelm", "name of the Serve application: one per set of replicas on a cluster",
        group="scale-out on Ray Serve", metavar="NAME", pattern=r"^[A-Za-z0-9_.-]+$",
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

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _parse_memory(cls, value: Any) -> Any:
        return parse_memory(value)

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

    @field_validator("embedding_model", "speculative_model", mode="before")
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
            cpu_matmul=self.cpu_matmul,
            speculative_method=self.speculative_method,
            speculative_model=self.speculative_model,
            num_speculative_tokens=self.num_speculative_tokens,
            speculative_ngram_min=self.speculative_ngram_min,
            speculative_ngram_max=self.speculative_ngram_max,
            speculative_max_batch_size=self.speculative_max_batch_size,
        )

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
