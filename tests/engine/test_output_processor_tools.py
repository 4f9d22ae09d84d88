"""The output processor with a tool-call parser: each choice's text split into content and calls, without a model."""

from __future__ import annotations

from servelm.engine.outputs import accumulate
from servelm.engine.sampling_params import SamplingParams

from .test_output_processor import Harness

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
END = "!"  # the stop token that plays end-of-text


def run(h: Harness, seqs, texts: list[str]):
    """Step every choice through its text, one character a step, then its end token; the accumulated output."""
    total, deltas = None, []
    for step in range(max(len(t) for t in texts) + 1):
        tokens = {}
        for seq, text in zip(seqs, texts):
            if seq.finish_reason is None:
                tokens[seq] = ((text + END)[step], -0.1)
        for out in h.step(tokens):
            deltas.append(out)
            total = accumulate(total, out)
    return total, deltas


def test_each_choice_gets_its_own_content_and_calls():
    h = Harness()
    seqs = h.add("r", SamplingParams(n=2, stop_token_ids=[ord(END)], tool_call_parser="hermes"), max_tokens=500)
    total, deltas = run(h, seqs, ["Checking.\n" + CALL, "No call here."])
    first, second = total.outputs
    assert (first.text, [(c.index, c.name, c.arguments) for c in first.tool_calls]) == (
        "Checking.",
        [(0, "get_weather", '{"city": "Paris"}')],
    )
    assert (second.text, second.tool_calls) == ("No call here.", [])
    assert first.finish_reason == second.finish_reason == "stop"
    # The call streams: its name in one delta, its arguments over several later ones.
    pieces = [c for out in deltas for o in out.outputs if o.index == 0 for c in o.tool_calls]
    assert pieces[0].name == "get_weather" and pieces[0].arguments == ""
    assert len(pieces) > 3 and all(p.name is None for p in pieces[1:])
    # Token ids are still every generated token, calls included.
    assert len(first.token_ids) == len("Checking.\n" + CALL) + 1


def test_without_a_parser_the_call_is_text():
    h = Harness()
    (seq,) = h.add("r", SamplingParams(stop_token_ids=[ord(END)]), max_tokens=500)
    total, _ = run(h, [seq], [CALL])
    assert total.outputs[0].text == CALL and total.outputs[0].tool_calls == []


def test_text_held_back_by_the_parser_is_released_when_the_length_runs_out():
    h = Harness()
    text = "Use <tool_ca"
    (seq,) = h.add("r", SamplingParams(max_tokens=len(text), tool_call_parser="hermes"), max_tokens=len(text))
    total, deltas = run(h, [seq], [text])
    # The possible marker and the space before it wait until the end.
    assert "".join(o.text for out in deltas[:-1] for o in out.outputs) == "Use"
    assert total.outputs[0].text == text and total.outputs[0].finish_reason == "length"


def test_a_stop_string_ends_the_text_before_the_parser_sees_it():
    h = Harness()
    (seq,) = h.add("r", SamplingParams(stop=["</tool_call>"], tool_call_parser="hermes"), max_tokens=500)
    total, _ = run(h, [seq], [CALL + " more"])
    out = total.outputs[0]
    assert out.stop_reason == "</tool_call>" and out.text == ""
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("get_weather", '{"city": "Paris"}')]


def test_best_of_keeps_the_calls_of_the_winner():
    h = Harness()
    seqs = h.add(
        "r", SamplingParams(n=1, best_of=2, stop_token_ids=[ord(END)], tool_call_parser="hermes"), max_tokens=500
    )
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    total, deltas = None, []
    for step in range(len(text) + 1):
        tokens = {s: ((text + END)[step], lp) for s, lp in zip(seqs, (-2.0, -0.1)) if s.finish_reason is None}
        for out in h.step(tokens):
            deltas.append(out)
            total = accumulate(total, out)
    assert len(deltas) == 1  # best_of > n sends everything at the end
    assert [(c.name, c.arguments) for c in total.outputs[0].tool_calls] == [("f", "{}")]
