"""The output processor without a model: text, stop strings, deltas and best_of, over a character tokenizer."""

from __future__ import annotations

from servelm.engine.model_runner import SampledToken, StepResult
from servelm.engine.output_processor import OutputProcessor
from servelm.engine.outputs import accumulate
from servelm.engine.sampling_params import SamplingParams
from servelm.engine.sequence import Sequence


class CharTokenizer:
    """Token id i is the character chr(i): decoding is joining."""

    def __init__(self):
        self.text_decoder = self

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)

    def token_bytes(self, token_id):
        return chr(token_id).encode()


class Harness:
    """An output processor, with the scheduler's part (append, stop tokens, length) played by hand."""

    def __init__(self):
        self.finished: list[tuple[int, str, object]] = []
        self.proc = OutputProcessor(CharTokenizer(), self._finish)

    def _finish(self, seq: Sequence, reason: str, stop_reason) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.finished.append((seq.seq_id, reason, stop_reason))

    def add(self, rid: str, params: SamplingParams, max_tokens: int = 50, first_id: int = 0) -> list[Sequence]:
        prompt = [ord(c) for c in "hi"]
        seqs = [
            Sequence(
                first_id + i, rid, prompt, len(prompt), max_tokens, stop_token_ids=frozenset(params.stop_token_ids)
            )
            for i in range(params.best_of)
        ]
        self.proc.add_request(rid, "hi", prompt, params, seqs, arrival_time=0.0)
        return seqs

    def step(self, tokens: dict[Sequence, tuple[str, float]]):
        """One step; a string of several characters is a speculative step's accepted run."""
        result = StepResult()
        for seq, (chars, logprob) in tokens.items():
            run = [SampledToken(ord(c), logprob, None) for c in chars]
            for sampled in run:  # as the scheduler appends: up to the token that ends the sequence
                seq.append_token(sampled.token_id)
                stop = seq.stop_for_token(sampled.token_id)
                if stop is not None:
                    self._finish(seq, *stop)
                    break
            result.sampled[seq.seq_id] = run
        return self.proc.process(result)


def test_deltas_add_up_to_the_text_and_slice_the_sequence_tokens():
    h = Harness()
    (seq,) = h.add("r", SamplingParams(max_tokens=3), max_tokens=3)
    total = None
    for char in "abc":
        (out,) = h.step({seq: (char, -0.5)})
        assert out.outputs[0].token_ids == [ord(char)]  # only what is new
        total = accumulate(total, out)
    assert total.outputs[0].text == "abc" and total.finished
    assert (total.outputs[0].finish_reason, total.num_generated_tokens) == ("length", 3)
    assert total.outputs[0].cumulative_logprob == -1.5


def test_a_stop_string_ends_the_sequence_through_the_scheduler_and_is_cut():
    h = Harness()
    (seq,) = h.add("r", SamplingParams(stop=["xy"]))
    texts = []
    for char in "abxy":
        (out,) = h.step({seq: (char, 0.0)}) or [None]
        if out is not None:
            texts.append(out.outputs[0].text if out.outputs else "")
    assert h.finished == [(seq.seq_id, "stop", "xy")]
    assert "".join(texts) == "ab"
    assert out.finished and out.outputs[0].stop_reason == "xy"


def test_a_stop_token_is_not_shown_and_held_back_text_is_flushed():
    h = Harness()
    (seq,) = h.add("r", SamplingParams(stop=["zz"], stop_token_ids=[ord("!")]))
    (first,) = h.step({seq: ("z", 0.0)})
    assert first.outputs[0].text == ""  # "z" may start the stop string
    (last,) = h.step({seq: ("!", 0.0)})
    assert last.outputs[0].text == "z" and last.outputs[0].finish_reason == "stop"
    assert last.outputs[0].stop_reason == ord("!")


def test_best_of_holds_the_output_until_the_end_and_keeps_the_best():
    h = Harness()
    seqs = h.add("r", SamplingParams(n=1, best_of=2, max_tokens=2), max_tokens=2)
    assert h.step({seqs[0]: ("a", -3.0), seqs[1]: ("b", -0.1)}) == []
    (out,) = h.step({seqs[0]: ("a", -3.0), seqs[1]: ("b", -0.1)})
    assert [(c.index, c.text) for c in out.outputs] == [(0, "bb")] and out.finished


def test_a_failed_request_reports_its_error_and_ends_every_choice():
    h = Harness()
    seqs = h.add("r", SamplingParams(n=2))
    h.step({seqs[0]: ("a", 0.0), seqs[1]: ("b", 0.0)})
    out = h.proc.fail("r", "see the log")
    assert out.finished and out.error == "see the log"
    assert [c.finish_reason for c in out.outputs] == ["error", "error"]
    h.proc.remove("r")
    assert h.proc.fail("r", "again") is None


# ---- several tokens per step (speculative decoding) ---------------------------


def test_a_run_of_tokens_reads_as_the_same_tokens_one_step_each():
    one, many = Harness(), Harness()
    params = SamplingParams(stop=["xy"], logprobs=0)
    (a,) = one.add("r", params)
    (b,) = many.add("r", params)
    singles = [one.step({a: (c, -0.25)}) for c in "hello "]
    runs = [many.step({b: (run, -0.25)}) for run in ("hel", "lo ")]
    total_one = total_many = None
    for (out,) in singles:
        total_one = accumulate(total_one, out)
    for (out,) in runs:
        total_many = accumulate(total_many, out)
    c1, c2 = total_one.outputs[0], total_many.outputs[0]
    assert (c2.text, c2.token_ids) == (c1.text, c1.token_ids) == ("hello ", [ord(c) for c in "hello "])
    assert c2.cumulative_logprob == c1.cumulative_logprob == -1.5
    assert [lp.chosen.token_id for lp in c2.logprobs] == c2.token_ids


def test_a_stop_string_inside_a_run_cuts_the_run_there():
    h = Harness()
    (seq,) = h.add("r", SamplingParams(stop=["xy"]))
    (out,) = h.step({seq: ("abxycd", -1.0)})
    choice = out.outputs[0]
    assert (choice.text, choice.finish_reason, choice.stop_reason) == ("ab", "stop", "xy")
    assert choice.token_ids == [ord(c) for c in "abxy"]  # the accepted tokens after the stop string are gone
    assert seq.generated_token_ids == choice.token_ids
    assert choice.cumulative_logprob == -4.0 and h.finished == [(seq.seq_id, "stop", "xy")]


def test_a_stop_token_inside_a_run_ends_it_unshown():
    h = Harness()
    (seq,) = h.add("r", SamplingParams(stop_token_ids=[ord("!")]))
    (out,) = h.step({seq: ("ab!cd", 0.0)})
    choice = out.outputs[0]
    assert (choice.text, choice.finish_reason, choice.stop_reason) == ("ab", "stop", ord("!"))
    assert choice.token_ids == [ord(c) for c in "ab!"]


def test_max_tokens_reached_inside_a_run_keeps_the_run_up_to_it():
    h = Harness()
    (seq,) = h.add("r", SamplingParams(max_tokens=3, stop=["zz"]), max_tokens=3)
    (out,) = h.step({seq: ("abcde", 0.0)})
    choice = out.outputs[0]
    assert (choice.text, choice.finish_reason) == ("abc", "length")


# ---- logprobs follow the text --------------------------------------------------


def logprob_text(out) -> str:
    return "".join(lp.chosen.text for lp in out.outputs[0].logprobs)


def test_the_logprobs_of_a_stop_token_and_of_a_stop_string_are_cut_with_their_text():
    h = Harness()
    (seq,) = h.add("r", SamplingParams(stop=["xy"], logprobs=1))
    (out,) = h.step({seq: ("abxycd", -1.0)})
    assert out.outputs[0].text == logprob_text(out) == "ab"
    h = Harness()
    (seq,) = h.add("r", SamplingParams(stop_token_ids=[ord("!")], logprobs=0))
    (out,) = h.step({seq: ("ab!", -1.0)})
    assert out.outputs[0].text == logprob_text(out) == "ab"
    assert out.outputs[0].cumulative_logprob == -3.0  # the stop token's logprob still counts there
    h = Harness()
    (seq,) = h.add("r", SamplingParams(stop=["xy"], include_stop_str_in_output=True, logprobs=0))
    (out,) = h.step({seq: ("abxycd", -1.0)})
    assert out.outputs[0].text == logprob_text(out) == "abxy"


def test_a_streamed_tokens_logprobs_wait_while_its_text_may_be_a_stop_string():
    h = Harness()
    (seq,) = h.add("r", SamplingParams(stop=["xyz"], logprobs=0))
    deltas = [h.step({seq: (c, -1.0)})[0] for c in "axy"]
    assert [(d.outputs[0].text, logprob_text(d)) for d in deltas] == [("a", "a"), ("", ""), ("", "")]
    (out,) = h.step({seq: ("q", -1.0)})  # not the stop string after all: the held tokens come out with their text
    assert (out.outputs[0].text, logprob_text(out)) == ("xyq", "xyq")
    (out,) = h.step({seq: ("x", -1.0)})
    assert (out.outputs[0].text, logprob_text(out)) == ("", "")
    (out,) = h.step({seq: ("yz", -1.0)})  # the stop string: its tokens' logprobs never come out
    assert (out.outputs[0].text, logprob_text(out), out.outputs[0].finish_reason) == ("", "", "stop")


def test_held_back_logprobs_come_out_when_the_length_limit_ends_the_text():
    h = Harness()
    (seq,) = h.add("r", SamplingParams(stop=["xy"], logprobs=0, max_tokens=2), max_tokens=2)
    (first,) = h.step({seq: ("a", -1.0)})
    assert (first.outputs[0].text, logprob_text(first)) == ("a", "a")
    (last,) = h.step({seq: ("x", -1.0)})
    assert (last.outputs[0].text, logprob_text(last), last.outputs[0].finish_reason) == ("x", "x", "length")
