"""Per-request sampling parameters, with the fields of OpenAI's and vLLM's APIs."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import struct
from dataclasses import dataclass, field

from servelm.engine.params_error import SamplingParamsError as SamplingParamsError  # re-exported
from servelm.engine.structured_outputs import StructuredOutputsParams
from servelm.engine.tool_parsers.registry import FORMATS

# The sampler computes in float32: a parameter must survive that conversion.
# Below the smallest normal float32 a divisor or a threshold turns into 0 or a
# subnormal whose reciprocal overflows; above the largest it is infinity.
FLOAT32_MIN_NORMAL = 1.1754943508222875e-38
FLOAT32_MAX = 3.4028234663852886e38


def float32_problem(value: float) -> str | None:
    """Why ``value`` cannot be used as a float32 sampling parameter, or None if it can."""
    if value == 0.0:
        return None
    try:
        (as_f32,) = struct.unpack("f", struct.pack("f", value))
    except OverflowError:
        return f"is too large (float32, the sampler's type, ends at {FLOAT32_MAX:.4g})"
    if math.isinf(as_f32):
        return f"is too large (float32, the sampler's type, ends at {FLOAT32_MAX:.4g})"
    if abs(as_f32) < FLOAT32_MIN_NORMAL:
        return f"is too close to 0 (float32, the sampler's type, has no normal number below {FLOAT32_MIN_NORMAL:.4g})"
    return None


# Most stop strings a request may give.
MAX_STOP_STRINGS = 64
# How much of a bad value an error message shows.
_SHOWN_CHARS = 200


def _json(value: object) -> str:
    """A value for an error message: JSON, cut short (a request may send a megabyte of it)."""
    try:
        text = json.dumps(value, default=str)
    except (TypeError, ValueError):
        text = json.dumps(str(value))
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."


@dataclass
class SamplingParams:
    """How to sample one request's completions.

    Defaults follow vLLM: temperature 1.0, no truncation, no penalties.
    ``temperature == 0`` means greedy decoding. Construction validates every
    field and raises :class:`SamplingParamsError` naming the bad one.
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k truncation
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (0: only the sampled one)
    prompt_logprobs: int | None = None  # likewise for prompt tokens (echo)
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output (JSON schema, regex, ...)
    # The tool-call format to read the text in (servelm.engine.tool_parsers): each
    # choice's text is then split into content and tool calls. None: plain text.
    tool_call_parser: str | None = None
    # False: never speculate for this request; True: speculate where the engine has a method and it applies.
    speculative: bool = True
    # Not an API field. Tokens this request generated before it was resumed here (a Ray replica
    # failover, servelm/connectors/ray_resume.py): they end the prompt, and the frequency and
    # presence penalties still count them as output, so the continuation is the one without the cut.
    prior_output_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids", "prior_output_token_ids"):
            try:
                setattr(self, name, list(getattr(self, name) or []))
            except TypeError:
                raise SamplingParamsError(name, f"{name} must be a list") from None
        if self.best_of is None:
            self.best_of = self.n
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError):
                raise SamplingParamsError("logit_bias", "logit_bias must map token ids to numbers") from None
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise SamplingParamsError(name, f"{name} {why}, got {_json(getattr(self, name))}")

        # A string would make the range checks below raise TypeError, and an
        # infinite temperature or penalty turns banned logits into NaN.
        real_fields = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
        for name in real_fields:
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or not math.isfinite(value):
                bad(name, "must be a finite number")
            problem = float32_problem(float(value))
            if problem is not None:
                bad(name, problem)
        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if not isinstance(self.best_of, int) or self.best_of < self.n:
            bad("best_of", f"must be an integer >= n ({self.n})")
        if not self.temperature >= 0.0:
            bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", "must be -1 (disabled), 0 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            bad("repetition_penalty", "must be > 0")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", "must be an integer")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            bad("logprobs", "must be an integer >= 0")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0):
            bad("prompt_logprobs", "must be an integer >= 0")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            bad("stop", "must be non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            # Every new token is checked against each of them, on the engine's thread: thousands
            # would slow every request in the batch.
            bad("stop", f"may hold at most {MAX_STOP_STRINGS} strings (OpenAI takes 4)")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if not isinstance(self.speculative, bool):
            bad("speculative", "must be true or false")
        if self.logit_bias is not None and any(not -100.0 <= v <= 100.0 for v in self.logit_bias.values()):
            bad("logit_bias", "values must be in [-100, 100]")
        if self.tool_call_parser is not None and self.tool_call_parser not in FORMATS:
            bad("tool_call_parser", f"must be one of {', '.join(FORMATS)}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise SamplingParamsError("structured_outputs", "structured_outputs must be a StructuredOutputsParams")

    def check_vocab(self, vocab_size: int) -> None:
        """Raise :class:`SamplingParamsError` for a token id outside ``[0, vocab_size)``.

        Separate from construction because only the engine knows its
        vocabulary; it calls this before queueing. OpenAI and vLLM reject such
        ids rather than ignoring them.
        """
        for name, ids in (("logit_bias", list(self.logit_bias or ())), ("stop_token_ids", self.stop_token_ids)):
            for tok in ids:
                if not 0 <= tok < vocab_size:
                    raise SamplingParamsError(
                        name, f"{name} holds token id {tok}, outside the model's vocabulary [0, {vocab_size})"
                    )

    def parsing_tool_calls(self, fmt: str) -> SamplingParams:
        """A copy whose text is read for tool calls in the format ``fmt``.

        Special tokens stay in the text when the format's markers are ones
        (Mistral's ``[TOOL_CALLS]``, Llama's ``<|python_tag|>``).
        """
        keep_special = FORMATS[fmt].keep_special_tokens
        return dataclasses.replace(
            self, tool_call_parser=fmt, skip_special_tokens=self.skip_special_tokens and not keep_special
        )

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0.0 or self.top_k == 1
