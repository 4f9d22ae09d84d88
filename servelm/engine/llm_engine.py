"""The synchronous serving engine: requests in, one ``step()`` at a time, outputs out.

Not thread-safe: one thread calls ``add_request``/``abort_request``/``step``
(the async engine's loop thread, or the offline ``LLM``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from itertools import count
from typing import TYPE_CHECKING

from servelm.engine.block_manager import BlockManager
from servelm.engine.config import EngineConfig
from servelm.engine.context_limit import context_length_error
from servelm.engine.detokenizer import IncrementalDetokenizer
from servelm.engine.grammar_compiler import GrammarCompiler
from servelm.engine.grammar_matcher import GrammarMatcher
from servelm.engine.model_runner import ModelRunner, StepResult
from servelm.engine.outputs import CompletionOutput, EngineStats, PositionLogprobs, RequestOutput, TokenLogprob
from servelm.engine.sampler import SamplingState, make_generator
from servelm.engine.sampling_params import SamplingParams
from servelm.engine.scheduler import Scheduler
from servelm.engine.sequence import Sequence
from servelm.engine.vocabulary import vocabulary_error

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

logger = logging.getLogger(__name__)


class PromptTooLongError(ValueError):
    """The prompt plus the requested completion exceed the model's context."""


class InvalidPromptError(ValueError):
    """A prompt the engine cannot run (empty, token ids outside the vocabulary, larger than the KV cache)."""


@dataclass
class _SeqState:
    """One choice of a request: its sequence, detokenizer and output so far."""

    seq: Sequence
    output: CompletionOutput
    detok: IncrementalDetokenizer
    sampling: SamplingState
    # How much of ``output`` has been handed out already (delta mode).
    sent_tokens: int = 0
    sent_text: int = 0
    sent_logprobs: int = 0
    finish_sent: bool = False


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    choices: list[_SeqState]
    arrival_time: float
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False
    num_cached_tokens: int = 0
    error: str | None = None
    first_scheduled_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(c.output.finished for c in self.choices)

    @property
    def streams(self) -> bool:
        # best_of > n picks the winners at the end: nothing can be sent before.
        return self.params.best_of == self.params.n


class LLMEngine:
    """Continuous-batching engine over one decoder model.

    ``step()`` schedules, runs the model once and returns one delta
    :class:`RequestOutput` per request that progressed.
    """

    def __init__(self, model: str, config: EngineConfig | None = None):
        self.config = config or EngineConfig()
        self.runner = ModelRunner(model, self.config)
        self.tokenizer = self.runner.tokenizer
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(
            self.runner.num_blocks, self.config.block_size, self.config.enable_prefix_caching
        )
        self.scheduler = Scheduler(self.config, self.block_manager)
        # Structured outputs: compiles (and caches) each request's grammar; thread-safe.
        self.grammars = GrammarCompiler(
            self.tokenizer, self.runner.model_config.vocab_size, self.tokenizer.eos_token_ids
        )
        self.requests: dict[str, _Request] = {}
        self._seqs: dict[int, _SeqState] = {}
        self._seq_ids = count()
        self._token_text: dict[int, str] = {}

    # -- admission -----------------------------------------------------

    def prepare_prompt(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Tokenize and validate a prompt against the context and the KV cache.

        Pure with respect to engine state, so the async engine can call it
        from the event loop and report errors before queueing. Also checks
        the token ids in ``params`` against the vocabulary
        (:class:`SamplingParamsError`).
        """
        params.check_vocab(self.runner.model_config.vocab_size)
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            token_ids = list(prompt)
            outside = vocabulary_error(token_ids, self.runner.model_config.vocab_size)
            if outside is not None:
                raise InvalidPromptError(f"prompt {outside}")
        if not token_ids:
            raise InvalidPromptError("the prompt is empty")
        n = len(token_ids)
        too_long = context_length_error(self.max_model_len, n, params.max_tokens, "prompt")
        if too_long is not None:
            raise PromptTooLongError(too_long)
        max_tokens = self._max_tokens(n, params)
        if max_tokens < 1 or not self.scheduler.can_ever_fit(n + max_tokens):
            raise InvalidPromptError(
                f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) can never fit in the KV cache "
                f"({self.block_manager.capacity_tokens} tokens); lower max_tokens or give the server more kv_cache_memory"
            )
        return token_ids

    def _max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        """The generation cap: the client's max_tokens, or else all the room left.

        Without a max_tokens the room is bounded by the KV cache as well as
        the context, so a small cache does not refuse requests that name none.
        """
        if params.max_tokens is not None:
            return min(params.max_tokens, self.max_model_len - prompt_len)
        return min(self.max_model_len, self.block_manager.capacity_tokens) - prompt_len

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
        grammar: CompiledGrammar | None = None,
    ) -> None:
        """Queue a request; its ``best_of`` sequences start at the next step.

        ``grammar`` is ``params.structured_outputs`` compiled by
        ``self.grammars`` (the async engine compiles it in a worker thread
        first); when it is None for a constrained request it is compiled
        here, blocking.
        """
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        if prompt_token_ids is None:
            prompt_token_ids = self.prepare_prompt(prompt, params)
        if params.structured_outputs is not None and grammar is None:
            grammar = self.grammars.compile(params.structured_outputs)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        max_tokens = self._max_tokens(len(prompt_token_ids), params)
        req = _Request(
            request_id=request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=prompt_token_ids,
            params=params,
            choices=[],
            arrival_time=arrival,
        )
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(prompt_token_ids)
        eos = set() if params.ignore_eos else set(self.tokenizer.eos_token_ids)
        # A grammar ends on EOS even under ignore_eos: nothing else may follow its end.
        grammar_stops = set(self.tokenizer.eos_token_ids) | set(params.stop_token_ids)
        for index in range(params.best_of):
            seq = Sequence(
                seq_id=next(self._seq_ids),
                request_id=request_id,
                token_ids=list(prompt_token_ids),
                num_prompt_tokens=len(prompt_token_ids),
                max_tokens=max_tokens,
                arrival_time=arrival,
            )
            if params.prompt_logprobs is not None and index == 0:
                # Cached prompt blocks are never recomputed, so their logprobs
                # would be missing: this sequence computes its whole prompt.
                seq.use_prefix_cache = False
            output = CompletionOutput(index=index, logprobs=[] if params.logprobs is not None else None)
            seed = None if params.seed is None else params.seed + index
            sampling = SamplingState(
                params=params,
                prompt_token_ids=prompt_token_ids,
                output_token_ids=output.token_ids,
                generator=make_generator(seed, self.runner.device),
                eos_token_ids=eos,
                grammar=None if grammar is None else GrammarMatcher(grammar, grammar_stops),
            )
            detok = IncrementalDetokenizer(self.tokenizer.hf, prompt_token_ids, params)
            state = _SeqState(seq=seq, output=output, detok=detok, sampling=sampling)
            req.choices.append(state)
            self._seqs[seq.seq_id] = state
        self.requests[request_id] = req
        for state in req.choices:
            self.scheduler.add(state.seq)

    def abort_request(self, request_id: str) -> None:
        """Drop a request; its KV blocks are freed at once."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        self.scheduler.abort(request_id)
        for state in req.choices:
            self._seqs.pop(state.seq.seq_id, None)

    def fail_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        """End requests with an error (e.g. their step raised); returns their final outputs.

        The error a client sees names only its request id: what went wrong
        is in the server log (logged by the caller under the same id), never
        in a response.
        """
        outputs = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            req.error = f"see the server log under request id {rid}"
            for state in req.choices:
                if not state.output.finished:
                    state.output.finish_reason = "error"
            outputs.append(self._make_output(req))
            self.abort_request(rid)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self, model: str) -> EngineStats:
        """The engine's gauges and running totals, labelled ``model``.

        Plain reads of counters: safe to call from another thread, where
        the figures are a snapshot that may be one step old.
        """
        bm, runner = self.block_manager, self.runner
        return EngineStats(
            model=model,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=bm.usage,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            dtype=str(runner.dtype).removeprefix("torch."),
            device=str(runner.device),
            kv_cache_tokens=runner.num_blocks * self.config.block_size,
            kv_cache_bytes=runner.num_blocks * runner.block_bytes,
        )

    # -- the step ------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and return outputs of requests that progressed."""
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        scheduled = out.scheduled
        now = time.monotonic()
        for s in out.prefills:
            req = self.requests[s.seq.request_id]
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
        sampling = {s.seq.seq_id: self._seqs[s.seq.seq_id].sampling for s in scheduled if s.is_sampling}
        want_prompt_logprobs = {}
        for s in out.prefills:
            req = self.requests[s.seq.request_id]
            if req.prompt_logprobs is not None and s.seq is req.choices[0].seq:
                want_prompt_logprobs[s.seq.seq_id] = req.params.prompt_logprobs
        try:
            result = self.runner.execute(out, sampling, want_prompt_logprobs)
        except Exception:  # a failing step fails its requests, not the engine
            ids = list(dict.fromkeys(s.seq.request_id for s in scheduled))
            logger.exception("engine step failed; failing requests %s", ", ".join(ids))
            return self.fail_requests(ids)
        self.scheduler.postprocess(out)
        progressed = self._apply(result, scheduled)
        # Sequences whose own sampling failed (the runner isolates them, _apply adds tokens a
        # grammar refused): only their requests fail.
        failed = list(dict.fromkeys(self._seqs[seq_id].seq.request_id for seq_id in result.failed))
        outputs = self.fail_requests(failed)
        progressed = [rid for rid in progressed if rid in self.requests]
        for rid in progressed:
            req = self.requests[rid]
            if req.finished or req.streams:
                outputs.append(self._make_output(req))
            if req.finished:
                del self.requests[rid]
                for state in req.choices:
                    self._seqs.pop(state.seq.seq_id, None)
        return outputs

    def _apply(self, result: StepResult, scheduled) -> list[str]:
        """Record the step's prompt logprobs and sampled tokens; returns the ids of requests that progressed."""
        progressed: dict[str, None] = {}  # insertion-ordered set
        for seq_id, positions in result.prompt_logprobs.items():
            state = self._seqs[seq_id]
            req = self.requests[state.seq.request_id]
            for p in positions:
                token_id = req.prompt_token_ids[p.position]
                req.prompt_logprobs[p.position] = self._position_logprobs(token_id, p.logprob, p.top_logprobs)
        for s in scheduled:
            if s.is_sampling and s.seq.num_generated_tokens == 0:
                req = self.requests[s.seq.request_id]
                req.num_cached_tokens = max(req.num_cached_tokens, s.seq.num_cached_tokens)
        for seq_id, sampled in result.sampled.items():
            state = self._seqs[seq_id]
            if not self._append_token(state, sampled.token_id, sampled.logprob, sampled.top_logprobs):
                result.failed.append(seq_id)
                continue
            progressed[state.seq.request_id] = None
        return list(progressed)

    def _append_token(self, state: _SeqState, token_id: int, logprob: float, top) -> bool:
        """Add a sampled token and finish the sequence where it stops; False if its grammar refuses it."""
        seq, out, params = state.seq, state.output, state.sampling.params
        grammar = state.sampling.grammar
        if grammar is not None and not grammar.accept(token_id):
            # The sampler only picks allowed tokens; this takes NaN logits on every one of them.
            logger.error("request %s: sampled token %d, which its grammar does not allow", seq.request_id, token_id)
            return False
        seq.append_token(token_id)
        out.token_ids.append(token_id)
        out.cumulative_logprob += logprob
        if out.logprobs is not None:
            out.logprobs.append(self._position_logprobs(token_id, logprob, top or []))
        if token_id in params.stop_token_ids:
            self._finish(state, "stop", token_id)
        elif not params.ignore_eos and token_id in self.tokenizer.eos_token_ids:
            self._finish(state, "stop", None)
        else:
            text, stop = state.detok.add_token(token_id)
            out.text += text
            if stop is not None:
                self._finish(state, "stop", stop, flush=False)
        if not out.finished and grammar is not None and grammar.is_terminated:
            self._finish(state, "stop", None)  # a stop token ended the grammar, and ignore_eos kept going
        if not out.finished and (seq.num_generated_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len):
            self._finish(state, "length", None)
        return True

    def _finish(self, state: _SeqState, reason: str, stop_reason, flush: bool = True) -> None:
        if flush:
            state.output.text += state.detok.flush()
        state.output.finish_reason = reason
        state.output.stop_reason = stop_reason
        self.scheduler.finish(state.seq)

    # -- outputs -------------------------------------------------------

    def _token_str(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    def _position_logprobs(self, token_id: int, logprob: float, top) -> PositionLogprobs:
        return PositionLogprobs(
            chosen=TokenLogprob(token_id, logprob, self._token_str(token_id)),
            top=[TokenLogprob(t, lp, self._token_str(t)) for t, lp in top],
        )

    def _make_output(self, req: _Request) -> RequestOutput:
        """A delta output: what changed since the last one for this request."""
        choices = req.choices
        if not req.streams:
            choices = sorted(choices, key=lambda c: c.output.cumulative_logprob, reverse=True)[: req.params.n]
        deltas = []
        for new_index, state in enumerate(choices):
            out = state.output
            if state.finish_sent:
                continue
            delta = CompletionOutput(
                index=new_index if not req.streams else out.index,
                text=out.text[state.sent_text :],
                token_ids=out.token_ids[state.sent_tokens :],
                logprobs=out.logprobs[state.sent_logprobs :] if out.logprobs is not None else None,
                cumulative_logprob=out.cumulative_logprob,
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
            )
            if not delta.token_ids and not delta.text and delta.finish_reason is None:
                continue
            state.sent_text = len(out.text)
            state.sent_tokens = len(out.token_ids)
            state.sent_logprobs = len(out.logprobs) if out.logprobs is not None else 0
            state.finish_sent = out.finished
            deltas.append(delta)
        prompt_logprobs = None
        if req.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            prompt_logprobs = req.prompt_logprobs
            req.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=deltas,
            finished=req.finished or req.error is not None,
            delta=True,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=req.num_cached_tokens,
            num_generated_tokens=sum(len(c.output.token_ids) for c in req.choices),
            error=req.error,
            queue_time=None if req.first_scheduled_time is None else req.first_scheduled_time - req.arrival_time,
        )
