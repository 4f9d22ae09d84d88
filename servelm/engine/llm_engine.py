"""The synchronous serving engine: requests in, one ``step()`` at a time, outputs out.

Not thread-safe: one thread calls ``add_request``/``abort_request``/``step``
(the async engine's loop thread, or the offline ``LLM``).
"""

from __future__ import annotations

import logging
import time
from itertools import count
from typing import TYPE_CHECKING

from servelm.engine.block_manager import BlockManager
from servelm.engine.config import EngineConfig
from servelm.engine.context_limit import context_length_error
from servelm.engine.grammar_compiler import GrammarCompiler
from servelm.engine.grammar_matcher import GrammarMatcher
from servelm.engine.model_runner import ModelRunner, StepResult
from servelm.engine.output_processor import OutputProcessor
from servelm.engine.outputs import EngineStats, RequestOutput
from servelm.engine.sampler import SamplingState, make_generator
from servelm.engine.sampling_params import SamplingParams
from servelm.engine.scheduler import Scheduler
from servelm.engine.sequence import Sequence
from servelm.engine.spec_decode.proposer import make_proposer, propose, speculative_tokens
from servelm.engine.vocabulary import vocabulary_error

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

logger = logging.getLogger(__name__)


# The client's error when its structured output's grammar leaves no token to sample.
_DEAD_END = (
    "The structured output's grammar allows no further token after the text generated so far: no text can complete it."
)


class PromptTooLongError(ValueError):
    """The prompt plus the requested completion exceed the model's context."""


class InvalidPromptError(ValueError):
    """A prompt the engine cannot run (empty, token ids outside the vocabulary, larger than the KV cache)."""


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
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler.finish)
        # Structured outputs: compiles (and caches) each request's grammar; thread-safe.
        self.grammars = GrammarCompiler(
            self.tokenizer, self.runner.model_config.vocab_size, self.tokenizer.eos_token_ids
        )
        self.proposer = make_proposer(self.config, self.runner.draft)
        # The request registry: each request's sequences, each sequence's sampling state,
        # and the sequence whose prefill reports prompt logprobs (k of them).
        self._requests: dict[str, list[Sequence]] = {}
        self._sampling: dict[int, SamplingState] = {}
        self._prompt_logprobs: dict[int, int] = {}
        self._seq_ids = count()

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
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running")
        if prompt_token_ids is None:
            prompt_token_ids = self.prepare_prompt(prompt, params)
        if params.structured_outputs is not None and grammar is None:
            grammar = self.grammars.compile(params.structured_outputs)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        max_tokens = self._max_tokens(len(prompt_token_ids), params)
        # A grammar allows EOS only where it ends, and nothing else once it must: there
        # EOS ends the sequence even under ignore_eos.
        keep_eos = not params.ignore_eos or grammar is not None
        eos = frozenset(self.tokenizer.eos_token_ids) if keep_eos else frozenset()
        seqs = []
        for index in range(params.best_of or params.n):  # best_of is n unless set
            seq = Sequence(
                seq_id=next(self._seq_ids),
                request_id=request_id,
                token_ids=prompt_token_ids,
                num_prompt_tokens=len(prompt_token_ids),
                max_tokens=max_tokens,
                arrival_time=arrival,
                stop_token_ids=frozenset(params.stop_token_ids),
                eos_token_ids=eos,
                num_speculative_tokens=speculative_tokens(self.config, params),
            )
            if params.prompt_logprobs is not None and index == 0:
                # Cached prompt blocks are never recomputed, so their logprobs
                # would be missing: this sequence computes its whole prompt.
                seq.use_prefix_cache = False
                self._prompt_logprobs[seq.seq_id] = params.prompt_logprobs
            seed = None if params.seed is None else params.seed + index
            self._sampling[seq.seq_id] = SamplingState(
                params=params,
                token_ids=seq.token_ids,
                num_prompt_tokens=seq.num_prompt_tokens,
                generator=make_generator(seed, self.runner.device),
                eos_token_ids=set(eos),
                grammar=None if grammar is None else GrammarMatcher(grammar, eos | seq.stop_token_ids),
            )
            seqs.append(seq)
        self._requests[request_id] = seqs
        self.output_processor.add_request(
            request_id, prompt if isinstance(prompt, str) else None, prompt_token_ids, params, seqs, arrival
        )
        for seq in seqs:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Drop a request; its KV blocks are freed at once."""
        if request_id not in self._requests:
            return
        self.scheduler.abort(request_id)
        self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        for seq in self._requests.pop(request_id, ()):
            self._sampling.pop(seq.seq_id, None)
            self._prompt_logprobs.pop(seq.seq_id, None)
        self.output_processor.remove(request_id)

    def fail_requests(
        self, request_ids: list[str], message: str | None = None, code: str | None = None
    ) -> list[RequestOutput]:
        """End requests with an error (e.g. their step raised); returns their final outputs.

        Without a ``message`` the error a client sees names only its request
        id: what went wrong is in the server log (logged by the caller under
        the same id), never in a response. A ``code`` makes it the request's
        own error (:attr:`RequestOutput.error_code`), with ``message`` for the client.
        """
        outputs = []
        for rid in request_ids:
            out = self.output_processor.fail(rid, message or f"see the server log under request id {rid}", code)
            if out is not None:
                outputs.append(out)
            self.abort_request(rid)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

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
            spec_decode_drafts=self.scheduler.num_drafts,
            spec_decode_draft_tokens=self.scheduler.num_draft_tokens,
            spec_decode_accepted_tokens=self.scheduler.num_accepted_tokens,
        )

    # -- the step ------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and return outputs of requests that progressed.

        The step reads top-down: the scheduler plans it, the proposer (with
        speculative decoding) fills in the proposed tokens of the decodes that
        speculate, the runner computes it and samples or verifies, the
        scheduler appends the tokens and ends the sequences that stopped
        (freeing their blocks, rolling back rejected proposals' slots), and
        the output processor turns the tokens into text and delta outputs.
        """
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        self.output_processor.mark_scheduled(out, time.monotonic())
        scheduled = out.scheduled
        sampling = {s.seq.seq_id: self._sampling[s.seq.seq_id] for s in scheduled if s.is_sampling}
        want_prompt_logprobs = {
            s.seq.seq_id: self._prompt_logprobs[s.seq.seq_id]
            for s in out.prefills
            if s.seq.seq_id in self._prompt_logprobs
        }
        try:
            speculating = out.speculating
            probs = propose(self.proposer, speculating, sampling) if self.proposer and speculating else {}
            result = self.runner.execute(out, sampling, want_prompt_logprobs, probs)
        except Exception:  # a failing step fails its requests, not the engine
            ids = list(dict.fromkeys(s.seq.request_id for s in scheduled))
            logger.exception("engine step failed; failing requests %s", ", ".join(ids))
            return self.fail_requests(ids)
        dead_ends = self._advance_grammars(result)
        self.scheduler.update_from_output(
            out, {seq_id: [s.token_id for s in run] for seq_id, run in result.sampled.items()}
        )
        # Sequences whose own sampling failed (the runner isolates them, or their grammar
        # refused the token): only their requests fail.
        request_of = {s.seq.seq_id: s.seq.request_id for s in scheduled}
        failed = list(dict.fromkeys(request_of[seq_id] for seq_id in result.failed))
        dead = {request_of[seq_id] for seq_id in dead_ends}
        outputs = self.fail_requests([rid for rid in failed if rid not in dead])
        outputs += self.fail_requests([rid for rid in failed if rid in dead], _DEAD_END, "invalid_structured_output")
        for output in self.output_processor.process(result):
            outputs.append(output)
            if output.finished:
                self._forget(output.request_id)
        return outputs

    def _advance_grammars(self, result: StepResult) -> set[int]:
        """Advance each constrained sequence's matcher over its sampled token (never over a recompute).

        A token its grammar refuses is taken out of ``result.sampled`` and the
        sequence counted as failed. The sampler only picks allowed tokens, so
        that takes NaN logits on every one of them, or a grammar that allows
        no token at all there: returns the sequences at such a dead end
        (their request's own error, not the engine's).
        """
        dead_ends = set()
        for seq_id, run in list(result.sampled.items()):
            grammar = self._sampling[seq_id].grammar
            if grammar is None:
                continue
            refused = next((s.token_id for s in run if not grammar.accept(s.token_id)), None)
            if refused is None:
                continue
            del result.sampled[seq_id]
            result.failed.append(seq_id)
            if grammar.allows_nothing():
                dead_ends.add(seq_id)
            else:
                logger.error("sequence %d sampled token %d, which its grammar does not allow", seq_id, refused)
        return dead_ends
