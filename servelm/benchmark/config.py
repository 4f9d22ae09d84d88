"""A benchmark run's settings, checked: what ``servelm bench serve``'s flags describe."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from servelm.benchmark.dataset import load_prompt_file, parse_range
from servelm.benchmark.metrics import level_label, parse_slos
from servelm.clients import server_base_url

DEFAULT_INPUT_LEN = 128
DEFAULT_NUM_PROMPTS = 100


@dataclass(frozen=True)
class Level:
    """One load level: a fixed concurrency, Poisson arrivals at a rate, or a rate capped by a concurrency."""

    concurrency: int | None
    request_rate: float | None

    @property
    def label(self) -> str:
        """``c=8``, ``r=2`` or ``r=2,c=8``."""
        return level_label(self.concurrency, self.request_rate)


@dataclass
class BenchConfig:
    """Everything a run needs; built by :func:`config_from_args`, or directly by a test."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    api_key: str | None = None
    endpoint: str = "completions"
    timeout: float = 600.0
    num_prompts: int = DEFAULT_NUM_PROMPTS
    input_len: int = DEFAULT_INPUT_LEN
    prompts: list[str] | None = None  # from --prompt-file
    prompt_file: str | None = None
    tokenizer: str | None = None
    output_len: int = 128
    output_len_range: tuple[int, int] | None = None
    ignore_eos: bool = True
    min_tokens: bool = False
    temperature: float | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    levels: list[Level] = field(default_factory=lambda: [Level(1, None)])
    warmup: int = 0
    slos: dict[str, float] = field(default_factory=dict)
    result_json: str | None = None
    save_detailed: bool = False
    plot: str | None = None
    progress: bool | None = None

    def params(self) -> dict[str, Any]:
        """The run's parameters for the result file: no API key, no prompt texts."""
        data = asdict(self)
        data.pop("prompts")
        data["api_key"] = "(set)" if self.api_key else None
        return data


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The run described by parsed ``bench serve`` flags; raises ValueError naming a bad one."""
    prompts = None
    if args.prompt_file is not None:
        if args.input_len is not None:
            raise ValueError("--input-len is for synthetic prompts, not with --prompt-file")
        if args.tokenizer is not None:
            raise ValueError("--tokenizer is for synthetic prompts, not with --prompt-file")
        try:
            prompts = load_prompt_file(args.prompt_file)
        except OSError as exc:
            raise ValueError(f"--prompt-file: {exc}") from None
        except ValueError as exc:
            raise ValueError(f"--prompt-file: {exc}") from None
    span = None
    if args.output_len_range is not None:
        try:
            span = parse_range(args.output_len_range)
        except ValueError as exc:
            raise ValueError(f"--output-len-range: {exc}") from None
    try:
        slos = parse_slos(args.goodput or [])
    except ValueError as exc:
        raise ValueError(f"--goodput: {exc}") from None
    extra_body = {}
    if args.extra_body is not None:
        try:
            extra_body = json.loads(args.extra_body)
        except ValueError as exc:
            raise ValueError(f"--extra-body: not valid JSON: {exc}") from None
        if not isinstance(extra_body, dict):
            raise ValueError("--extra-body: must be a JSON object")
    rates: list[float | None] = list(args.request_rate) if args.request_rate else [None]
    concurrencies: list[int | None] = (
        list(args.concurrency) if args.concurrency else [1 if args.request_rate is None else None]
    )
    levels = [Level(c, r) for r in rates for c in concurrencies]
    num_prompts = args.num_prompts or (len(prompts) if prompts is not None else DEFAULT_NUM_PROMPTS)
    base_url = server_base_url(args.base_url)
    if not base_url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url: {args.base_url!r} is not an http:// or https:// URL")
    return BenchConfig(
        base_url=base_url,
        model=args.model,
        api_key=args.api_key,
        endpoint=args.endpoint,
        timeout=args.timeout,
        num_prompts=num_prompts,
        input_len=args.input_len or DEFAULT_INPUT_LEN,
        prompts=prompts,
        prompt_file=args.prompt_file,
        tokenizer=args.tokenizer,
        output_len=args.output_len,
        output_len_range=span,
        ignore_eos=args.ignore_eos,
        min_tokens=args.min_tokens,
        temperature=args.temperature,
        extra_body=extra_body,
        seed=args.seed,
        levels=levels,
        warmup=args.warmup,
        slos=slos,
        result_json=args.result_json,
        save_detailed=args.save_detailed,
        plot=args.plot,
        progress=args.progress,
    )
