"""Run ``transformers serve`` so that it takes the benchmark's requests as vLLM does.

Two gaps of stock ``transformers serve`` (5.23) against the OpenAI/vLLM
protocol the benchmark client speaks, patched here before the ordinary CLI
starts; neither touches the generation loop:

- it answers 422 "Unexpected fields in the request" to any body key outside
  OpenAI's schema, and the benchmark sends ``ignore_eos: true`` with every
  request. Validation no longer sees ``ignore_eos``, and a request with it gets
  ``eos_token_id = -1`` in its generation config, which continuous batching
  reads as "no EOS" (its ``add_request`` passes the id through, and
  ``RequestState`` only keeps non-negative ids): generation runs to ``max_tokens``;
- its streams end after the last chunk without OpenAI's ``data: [DONE]``
  line, which clients that wait for it count as a broken stream. Streams of
  the chat and completions endpoints get that line appended.

Everything after the script name goes to ``transformers serve`` unchanged::

    python transformers_serve_launcher.py MODEL --continuous-batching --port 8102
"""

from __future__ import annotations

import sys


def patch_ignore_eos() -> None:
    """Teach the handlers' base class to accept and honour ``ignore_eos``."""
    from transformers.cli.serving import utils

    base = utils.BaseHandler
    validate = base._validate_request
    build = base._build_generation_config

    def _validate_request(self, body: dict) -> None:
        validate(self, {k: v for k, v in body.items() if k != "ignore_eos"})

    def _build_generation_config(self, body: dict, model_generation_config, use_cb: bool = False):
        config = build(self, body, model_generation_config, use_cb=use_cb)
        if body.get("ignore_eos"):
            config.eos_token_id = -1
        return config

    base._validate_request = _validate_request
    base._build_generation_config = _build_generation_config


def patch_done_line() -> None:
    """Append ``data: [DONE]`` to the SSE streams of /v1/chat/completions and /v1/completions."""
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler

    for handler in (ChatCompletionHandler, CompletionHandler):
        _append_done(handler)


def _append_done(handler: type) -> None:
    streaming = handler._streaming

    def _streaming(self, *args, **kwargs):
        response = streaming(self, *args, **kwargs)
        body = response.body_iterator

        async def with_done():
            async for chunk in body:
                yield chunk
            yield "data: [DONE]\n\n"

        response.body_iterator = with_done()
        return response

    handler._streaming = _streaming


def main() -> None:
    patch_ignore_eos()
    patch_done_line()
    # The CLI's own main() first asks the hub for a newer version; the app alone does not.
    from transformers.cli.transformers import app

    sys.argv = ["transformers", "serve", *sys.argv[1:]]
    app()


if __name__ == "__main__":
    main()
