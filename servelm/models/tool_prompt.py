"""Tools in a chat prompt: what the chat template gets when a conversation has tools or tool calls.

A template that reads ``tools`` (Qwen 2.5, Llama 3.1, Mistral) renders the
definitions, the assistant's ``tool_calls`` and the ``tool`` results itself;
it gets them as transformers passes them (arguments as objects, not JSON
strings). A template that does not (ChatML ones such as the bundled
SmolLM2's) would drop all of it, so the conversation is rewritten into
messages any template renders: the definitions and how to call them go into
the system message, past calls become the assistant's text in the model's
tool-call format, and results become user messages inside
``<tool_response>`` tags, the Hermes convention.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta

from servelm.engine.tool_parsers import ToolCallFormat

_NOT_ALNUM = re.compile(r"[^a-zA-Z0-9]")


def template_reads_tools(template: str) -> bool:
    """True when the template uses a ``tools`` variable (it renders tool definitions itself)."""
    env = jinja2.Environment(extensions=[jinja2.ext.loopcontrols, jinja2.ext.do])
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(template))
    except jinja2.TemplateSyntaxError:
        # A tag only transformers' environment knows (e.g. {% generation %}): a plain look.
        return re.search(r"\btools\b", template) is not None


def tool_messages(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    fmt: ToolCallFormat,
    template_knows_tools: bool,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and extra template variables to render a conversation with tools.

    ``messages`` are OpenAI-shaped dicts (``tool_calls`` with JSON-string
    arguments); ``tools`` are OpenAI tool definitions; ``fmt`` is the
    model's tool-call format.
    """
    if template_knows_tools:
        out = [_for_tool_template(m, fmt) for m in messages]
        return out, ({"tools": tools} if tools else {})
    out: list[dict[str, Any]] = []
    after_result = False
    for m in messages:
        if m["role"] == "tool":
            result = f"<tool_response>\n{m['content']}\n</tool_response>"
            if after_result:  # the results of one turn's calls share a message
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result})
            after_result = True
            continue
        after_result = False
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = fmt.calls_text([(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]])
            text = f"{m['content']}\n{calls}" if m.get("content") else calls
            out.append({k: v for k, v in m.items() if k != "tool_calls"} | {"content": text})
        else:
            out.append(dict(m))
    if tools:
        block = tools_system_prompt(tools, fmt)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, {}


def tools_system_prompt(tools: list[dict[str, Any]], fmt: ToolCallFormat) -> str:
    """The system-message block that offers ``tools`` to a model whose template knows nothing of them."""
    signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    example = fmt.calls_text([("<function-name>", "<arguments-json-object>")])
    return (
        "# Tools\n\n"
        "You may call one or more functions to help with the user's request. "
        "The functions are described inside <tools></tools>, one JSON object per line:\n"
        f"<tools>\n{signatures}\n</tools>\n\n"
        "To call a function, reply with its name and a JSON object of arguments, exactly like this:\n"
        f"{example}\n"
        "The results come back inside <tool_response></tool_response>."
    )


def _for_tool_template(message: dict[str, Any], fmt: ToolCallFormat) -> dict[str, Any]:
    """A message as tool-aware templates expect it: call arguments as objects, ids as the family needs."""
    m = dict(message)
    id_length = fmt.call_id_length
    if m.get("tool_calls"):
        calls = []
        for call in m["tool_calls"]:
            call = dict(call)
            function = dict(call["function"])
            function["arguments"] = _json_or_text(function["arguments"])
            call["function"] = function
            if id_length and "id" in call:
                call["id"] = _short_id(call["id"], id_length)
            calls.append(call)
        m["tool_calls"] = calls
    if id_length and m.get("tool_call_id"):
        m["tool_call_id"] = _short_id(m["tool_call_id"], id_length)
    return m


def _json_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except (TypeError, ValueError):
        return arguments  # not JSON: the template gets the text the client sent


def _short_id(call_id: str, length: int) -> str:
    # The last letters and digits: OpenAI-style ids ("call_" + random) stay distinct.
    return _NOT_ALNUM.sub("", call_id)[-length:].rjust(length, "0")
