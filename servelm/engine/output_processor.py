"""The engine's output side: new tokens into text, stop strings, logprob text and delta outputs.

By the time the output processor sees a step, the scheduler has appended
each sampled token to its sequence (several, after a speculative decode) and
ended the sequences that met a stop token, their end-of-text token or their
length. For each new token, in order, the output processor then

- turns it into text with the sequence's incremental detokenizer, which
  holds back text that may still become a stop string, and ends the
  sequence (through the scheduler) when a stop string appears, dropping
  any tokens of the same step after it;
- with a tool-call parser (``SamplingParams.tool_call_parser``), splits the
  text into content and tool-call pieces, each choice with its own parser;
- records its logprobs, with each token's bytes, and hands them on with
  the token's text: a token whose text turns out to be part of a stop
  string, and a stop token, have none in the output;
- and builds each request's delta :class:`RequestOutput`: what changed since
  the last one. A request with ``best_of > n`` streams nothing: its output
  waits until every choice ended, then holds the ``n`` best.

The token ids themselves live in the sequences: a delta's ids are a slice of
its sequence's, never a second copy kept here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from servelm.engine.detokenizer import IncrementalDetokenizer
from servelm.engine.model_runner import StepResult
from servelm.engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput, TokenLogprob, ToolCallDelta
from servelm.engine.sampling_params import SamplingParams
from servelm.engine.scheduler import SchedulerOutput
from servelm.engine.sequence import Sequence
from servelm.engine.tool_parsers import ToolCallParser, get_format

if TYPE_CHECKING:
    from servelm.models.tokenizer import Tokenizer

TopLogprobs = list[tuple[int, float]]  # (token id, logprob) pairs, best first

# scheduler.finish: ends a sequence with a reason and frees its KV blocks.
FinishFn = Callable[[Sequence, str, "str | int | None"], None]


@dataclass
class _Choice:
    """One choice of a request: its sequence, its text so far and how much of it was sent."""

    seq: Sequence
    index: int  # among the request's best_of sequences
    detok: IncrementalDetokenizer
    logprobs: list[PositionLogprobs] | None  # of the tokens whose text is out
    parser: ToolCallParser | None = None  # reads tool calls out of the text, when the request asks
    text: str = ""  # the content: with a parser, the text outside tool calls
    tool_calls: list[ToolCallDelta] = field(default_factory=list)  # the parser's pieces so far
    # Logprobs of tokens whose text the detokenizer holds back, each with where its text starts.
    held_logprobs: list[tuple[int, PositionLogprobs]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    num_tokens: int = 0  # generated tokens turned into text so far
    # How much has been handed out already (delta outputs).
    sent_tokens: int = 0
    sent_text: int = 0
    sent_logprobs: int = 0
    sent_tool_calls: int = 0
    finish_sent: bool = False


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    choices: list[_Choice]
    arrival_time: float
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False
    num_cached_tokens: int = 0
    error: str | None = None
    error_code: str | None = None
    first_scheduled_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(c.seq.finish_reason is not None for c in self.choices)

    @property
    def streams(self) -> bool:
        # best_of > n picks the winners at the end: nothing can be sent before.
        return self.params.best_of == self.params.n


class OutputProcessor:
    """Per-request output state, and the delta outputs of each step.

    ``tokenizer`` is the model's :class:`~servelm.models.tokenizer.Tokenizer`;
    ``finish`` ends a sequence that reached a stop string (the scheduler's
    :meth:`~servelm.engine.scheduler.Scheduler.finish`).
    """

    def __init__(self, tokenizer: Tokenizer, finish: FinishFn):
        self._tokenizer = tokenizer
        self._finish = finish
        self._requests: dict[str, _RequestState] = {}
        self._choices: dict[int, _Choice] = {}  # seq_id -> its choice

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seqs: list[Sequence],
        arrival_time: float,
    ) -> None:
        """Start tracking a request whose choices are ``seqs`` (in index order)."""
        choices = [
            _Choice(
                seq=seq,
                index=index,
                detok=IncrementalDetokenizer(self._tokenizer.text_decoder, prompt_token_ids, params),
                logprobs=[] if params.logprobs is not None else None,
                parser=get_format(params.tool_call_parser).parser() if params.tool_call_parser else None,
            )
            for index, seq in enumerate(seqs)
        ]
        state = _RequestState(request_id, prompt, prompt_token_ids, params, choices, arrival_time)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * len(prompt_token_ids)
        self._requests[request_id] = state
        for choice in choices:
            self._choices[choice.seq.seq_id] = choice

    def remove(self, request_id: str) -> None:
        """Stop tracking a request (finished, aborted or failed)."""
        state = self._requests.pop(request_id, None)
        for choice in state.choices if state is not None else ():
            self._choices.pop(choice.seq.seq_id, None)

    def mark_scheduled(self, out: SchedulerOutput, now: float) -> None:
        """Note when each request first runs (its queue time) and how much of its prompt was cached."""
        for s in out.prefills:
            state = self._requests.get(s.seq.request_id)
            if state is None:
                continue
            if state.first_scheduled_time is None:
                state.first_scheduled_time = now
            if s.seq.num_generated_tokens == 0:  # a recompute after preemption is not the prompt's cache hit
                state.num_cached_tokens = max(state.num_cached_tokens, s.seq.num_cached_tokens)

    def process(self, result: StepResult) -> list[RequestOutput]:
        """Turn the step's tokens into text and return the delta output of each request that progressed.

        Called after the scheduler appended the sampled tokens. A finished
        request's output is its last; the caller then removes the request.
        """
        for seq_id, positions in result.prompt_logprobs.items():
            choice = self._choices.get(seq_id)
            if choice is None:
                continue
            state = self._requests[choice.seq.request_id]
            assert state.prompt_logprobs is not None  # the runner reports them only where asked
            for p in positions:
                token_id = state.prompt_token_ids[p.position]
                state.prompt_logprobs[p.position] = self._position_logprobs(token_id, p.logprob, p.top_logprobs)
        progressed: dict[str, None] = {}  # insertion-ordered set
        for seq_id, run in result.sampled.items():
            choice = self._choices.get(seq_id)
            if choice is None:
                continue  # its request ended during the step
            # The scheduler appended the run up to the token that ended the sequence, if any.
            appended = run[: choice.seq.num_generated_tokens - choice.num_tokens]
            for i, sampled in enumerate(appended):
                last = i == len(appended) - 1
                if self._add_token(choice, sampled.token_id, sampled.logprob, sampled.top_logprobs, last):
                    break
            progressed[choice.seq.request_id] = None
        outputs = []
        for rid in progressed:
            state = self._requests[rid]
            if state.finished or state.streams:
                outputs.append(self._make_output(state))
        return outputs

    def fail(self, request_id: str, message: str, code: str | None = None) -> RequestOutput | None:
        """The final output of a request that failed inside the engine (None if unknown);
        ``code``: the request's own error (see :attr:`RequestOutput.error_code`)."""
        state = self._requests.get(request_id)
        if state is None:
            return None
        state.error, state.error_code = message, code
        for choice in state.choices:
            if choice.seq.finish_reason is None:
                choice.seq.finish_reason = "error"
        return self._make_output(state)

    def _add_token(self, choice: _Choice, token_id: int, logprob: float, top: TopLogprobs | None, last: bool) -> bool:
        """Add the sequence's next token (``last``: the newest it has); True when a stop string ended it here."""
        seq = choice.seq
        choice.num_tokens += 1
        choice.cumulative_logprob += logprob
        if last and seq.finish_reason == "stop":
            # A stop token or the end of text: its own text is never shown, nor its logprobs.
            self._add_text(choice, choice.detok.flush(), last=True)
            self._release_logprobs(choice)
            return False
        if choice.logprobs is not None:
            entry = self._position_logprobs(token_id, logprob, top or [])
            choice.held_logprobs.append((choice.detok.decoded_length, entry))
        text, stop = choice.detok.add_token(token_id)
        if stop is not None:
            # The stop string came with this token: it wins over a length limit reached by the same token,
            # and the tokens a speculative step accepted after it go.
            self._add_text(choice, text, last=True)
            self._release_logprobs(choice)
            seq.truncate(choice.num_tokens)
            self._finish(seq, "stop", stop)
            return True
        if last and seq.finish_reason is not None:
            self._add_text(choice, text + choice.detok.flush(), last=True)
        else:
            self._add_text(choice, text, last=False)
        self._release_logprobs(choice)
        return False

    @staticmethod
    def _release_logprobs(choice: _Choice) -> None:
        """Hand on the logprobs of the tokens whose text the detokenizer let out.

        A token's entry waits while its text is held back: that text may turn
        out to be part of a stop string, which is cut from the output with
        the tokens that wrote it, so that the tokens of the logprobs add up
        to the returned text. A token that holds only the first bytes of a
        character starts where that character does.
        """
        if choice.logprobs is None:
            return
        detok, held = choice.detok, choice.held_logprobs
        emitted = len(detok.output_text)
        count = 0
        while count < len(held) and held[count][0] < emitted:
            count += 1
        if detok.finished and detok.stop_reason is None:
            count = len(held)  # the end of the text (flush): every token's text is out
        choice.logprobs += [entry for _, entry in held[:count]]
        del held[: len(held) if detok.finished else count]

    @staticmethod
    def _add_text(choice: _Choice, text: str, last: bool) -> None:
        """Add released text to a choice: all of it, or its content and tool-call pieces with a parser."""
        parser = choice.parser
        if parser is None:
            choice.text += text
            return
        for parsed in (parser.feed(text), *((parser.finish(),) if last else ())):
            choice.text += parsed.content
            choice.tool_calls += parsed.tool_calls

    # -- logprob text ----------------------------------------------------

    def _position_logprobs(self, token_id: int, logprob: float, top: TopLogprobs) -> PositionLogprobs:
        token_bytes = self._tokenizer.token_bytes
        return PositionLogprobs(
            chosen=TokenLogprob(token_id, logprob, token_bytes(token_id)),
            top=[TokenLogprob(t, lp, token_bytes(t)) for t, lp in top],
        )

    # -- deltas ----------------------------------------------------------

    def _make_output(self, state: _RequestState) -> RequestOutput:
        """A delta output: what changed since the last one for this request."""
        choices = state.choices
        if not state.streams:
            choices = sorted(choices, key=lambda c: c.cumulative_logprob, reverse=True)[: state.params.n]
        deltas = []
        for new_index, choice in enumerate(choices):
            if choice.finish_sent:
                continue
            seq = choice.seq
            generated = seq.token_ids[seq.num_prompt_tokens + choice.sent_tokens :]
            delta = CompletionOutput(
                index=choice.index if state.streams else new_index,
                text=choice.text[choice.sent_text :],
                token_ids=generated,
                logprobs=choice.logprobs[choice.sent_logprobs :] if choice.logprobs is not None else None,
                cumulative_logprob=choice.cumulative_logprob,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                tool_calls=choice.tool_calls[choice.sent_tool_calls :],
            )
            if not delta.token_ids and not delta.text and not delta.tool_calls and delta.finish_reason is None:
                continue
            choice.sent_text = len(choice.text)
            choice.sent_tool_calls = len(choice.tool_calls)
            choice.sent_tokens += len(generated)
            choice.sent_logprobs = len(choice.logprobs) if choice.logprobs is not None else 0
            choice.finish_sent = seq.finish_reason is not None
            deltas.append(delta)
        prompt_logprobs = None
        if state.prompt_logprobs is not None and not state.prompt_logprobs_sent:
            prompt_logprobs = state.prompt_logprobs
            state.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=deltas,
            finished=state.finished or state.error is not None,
            delta=True,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=state.num_cached_tokens,
            num_generated_tokens=sum(c.seq.num_generated_tokens for c in state.choices),
            error=state.error,
            error_code=state.error_code,
            queue_time=None if state.first_scheduled_time is None else state.first_scheduled_time - state.arrival_time,
        )
