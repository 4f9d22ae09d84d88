"""The offline API, shaped like vLLM's: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from servelm.engine.config import EngineConfig
from servelm.engine.llm_engine import LLMEngine
from servelm.engine.outputs import RequestOutput, accumulate
from servelm.engine.sampling_params import SamplingParams
from servelm.engine.tool_parsers import detect_format


class LLM:
    """Run batched generation in this process.

    ``model`` is a bundled name (``smollm2-135m-instruct``), a Hugging Face
    folder or a .gguf file. Keyword arguments are :class:`EngineConfig`
    fields (dtype, device, max_num_seqs, kv_cache_memory, ...).
    """

    def __init__(self, model: str = "smollm2-135m-instruct", **engine_kwargs: Any):
        self.engine = LLMEngine(model, EngineConfig(**engine_kwargs))
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def generate(
        self,
        prompts: str | list[int] | Seq[str | list[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt, batched; outputs in prompt order.

        A prompt is a string or a list of token ids; ``params`` is one
        SamplingParams for all prompts or one per prompt.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        ids = []
        for prompt, p in zip(prompts, params):
            rid = str(self._next_id)
            self._next_id += 1
            self.engine.add_request(rid, prompt, p)
            ids.append(rid)
        results: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                results[delta.request_id] = accumulate(results.get(delta.request_id), delta)
        for rid in ids:
            if results[rid].error:
                raise RuntimeError(f"request {rid} failed: {results[rid].error}")
        return [results[rid] for rid in ids]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        params: SamplingParams | None = None,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate.

        With ``tools`` (OpenAI function definitions) the template offers them
        and each choice's text is read for tool calls (``outputs[i].text`` is
        the content, ``outputs[i].tool_calls`` the calls) in the format
        ``params.tool_call_parser`` names, by default the one the template
        implies.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        params = params or SamplingParams()
        fmt = None
        if tools:
            fmt = params.tool_call_parser or detect_format(chat_template or self.tokenizer.chat_template)
            params = params.parsing_tool_calls(fmt)
        prompts = []
        for conv in conversations:
            text = self.tokenizer.apply_chat_template(
                conv,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                tools=tools,
                tool_call_parser=fmt,
            )
            # The template already carries the model's special tokens.
            prompts.append(self.tokenizer.encode(text, add_special_tokens=False))
        return self.generate(prompts, params)
