"""Send one short streaming chat completion to a server on 127.0.0.1 and print what came back.

Standard library only, so any Python runs it::

    python3 bench/peers/smoke.py PORT [--model NAME] [--max-tokens 8] [--no-ignore-eos]

The default prompt makes SmolLM2 (bf16) answer "The answer to this classic math
problem is 4." in 11 tokens and then emit EOS, so with ``--max-tokens 32`` a
server that honours ``ignore_eos`` streams 32 tokens (finish_reason "length")
and without it stops after 11 (finish_reason "stop"). The request asks for
usage in the stream (``stream_options``), which a server may ignore. Exit
status 1 if the request failed or nothing streamed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("port", type=int)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompt", default="What is 2+2?")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--no-ignore-eos", action="store_true", help="leave ignore_eos out of the request")
    ap.add_argument("--no-usage", action="store_true", help="leave stream_options out of the request")
    ap.add_argument("--timeout", type=float, default=120)
    args = ap.parse_args()

    body = {
        "model": args.model,
        "messages": [{"role": "user", "content": args.prompt}],
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.no_usage:
        del body["stream_options"]
    if not args.no_ignore_eos:
        body["ignore_eos"] = True
    req = urllib.request.Request(
        f"http://127.0.0.1:{args.port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    text, chunks, finish, usage = [], 0, None, None
    t0 = time.perf_counter()
    ttft = None
    try:
        with urllib.request.urlopen(req, timeout=args.timeout) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                usage = event.get("usage") or usage
                for choice in event.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                        text.append(piece)
                        chunks += 1
                    finish = choice.get("finish_reason") or finish
    except urllib.error.HTTPError as err:
        print(f"HTTP {err.code}: {err.read().decode(errors='replace')[:500]}")
        return 1
    elapsed = time.perf_counter() - t0
    print(f"ignore_eos={not args.no_ignore_eos} max_tokens={args.max_tokens}")
    print(f"reply: {''.join(text)!r}")
    print(f"content chunks: {chunks}, finish_reason: {finish}, usage: {usage}")
    print(f"time to first content: {ttft if ttft is None else round(ttft, 3)}s, total {elapsed:.3f}s")
    return 0 if chunks else 1


if __name__ == "__main__":
    sys.exit(main())
