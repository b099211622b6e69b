"""A stand-in engine for the throughput benchmarks: asyncio, HTTP/1.1 keep-alive, one canned vLLM completion body.

Answers every ``POST /v1/completions`` with the same 200 body (the shape vLLM sends for ``logprobs=1`` and
``return_token_ids``) after a fixed service latency, ``GET /v1/models`` with one base card and ``/health`` with
an empty 200. It parses no JSON (but a prompt list's, below) and keeps no state, so the client is what the
benchmark measures. Stdlib only; run it in its own process::

    python benchmarks/_canned_engine.py --latency-ms 20 [--port 0] [--body FILE]

``--body FILE`` serves that file's bytes as the completion body instead (e.g. a scoring answer with prompt logprobs).
A request with a list of prompts (lora_sampler batches them) gets the canned choice ``n`` times per prompt, numbered
over the request as vLLM numbers them, and the usage times the prompts.

It prints one JSON line ``{"url": "http://127.0.0.1:PORT", "pid": PID}`` once it listens, and serves until
SIGTERM/SIGINT or until its standard input closes (so it never outlives a benchmark that died).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import threading
from typing import Dict, List, Optional, Tuple

#: The base model name in the canned bodies.
MODEL = "bench/base-model"
#: Generated tokens per canned completion (SamplingParams' default max_tokens).
TOKENS = 16
#: The answer to a request without a Content-Length that has a body (chunked): not needed by any contender.
LENGTH_REQUIRED = b"HTTP/1.1 411 Length Required\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


def completion_body() -> bytes:
    """Return the canned ``/v1/completions`` 200 body: one choice of ``TOKENS`` tokens with logprobs and token ids."""
    token_ids = [300 + 7 * i for i in range(TOKENS)]
    tokens = [f" t{t}" for t in token_ids]
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(TOKENS)]
    values = [-0.25 - 0.01 * i for i in range(TOKENS)]
    choice = {
        "index": 0,
        "text": "".join(tokens),
        "logprobs": {
            "text_offset": offsets,
            "token_logprobs": values,
            "tokens": tokens,
            "top_logprobs": [{token: value} for token, value in zip(tokens, values)],
        },
        "finish_reason": "length",
        "stop_reason": None,
        "token_ids": token_ids,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
    }
    body = {
        "id": "cmpl-canned",
        "object": "text_completion",
        "created": 1700000000,
        "model": MODEL,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {"prompt_tokens": 8, "total_tokens": 8 + TOKENS, "completion_tokens": TOKENS},
        "kv_transfer_params": None,
    }
    return json.dumps(body).encode()


def models_body() -> bytes:
    """Return the ``/v1/models`` body: one base-model card."""
    card = {"id": MODEL, "object": "model", "created": 1700000000, "owned_by": "vllm", "root": MODEL, "parent": None}
    return json.dumps({"object": "list", "data": [card]}).encode()


def _response(status: str, body: bytes, content_type: str = "application/json") -> bytes:
    head = f"HTTP/1.1 {status}\r\ndate: Thu, 01 Jan 2026 00:00:00 GMT\r\nserver: uvicorn\r\n"
    head += f"content-length: {len(body)}\r\ncontent-type: {content_type}\r\n\r\n"
    return head.encode() + body


COMPLETION = _response("200 OK", completion_body())
MODELS = _response("200 OK", models_body())
HEALTH = _response("200 OK", b"", "text/plain")
NOT_FOUND = _response("404 Not Found", b'{"detail":"Not Found"}')
#: A request body whose prompt is a list of prompts (texts or token-id lists), as lora_sampler batches them.
_PROMPT_LIST = re.compile(rb'"prompt"\s*:\s*\[\s*[\["]')
#: The batched answers made so far, by (canned answer, (prompts, n)).
_BATCHED: Dict[Tuple[bytes, Tuple[int, int]], bytes] = {}


class CannedHttp(asyncio.Protocol):
    """One keep-alive connection: parse request heads and bodies, answer each after the service latency."""

    def __init__(self, latency: float, completion: bytes = COMPLETION):
        self.latency, self.completion = latency, completion
        self.transport: Optional[asyncio.Transport] = None
        self.buffer = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Keep the transport."""
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        """Answer every complete request in the buffer (clients here never pipeline, but it would work)."""
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buffer[:end]).lower()
            length = 0
            marker = head.find(b"\r\ncontent-length:")
            if marker >= 0:
                stop = head.find(b"\r\n", marker + 2)
                length = int(head[marker + 17 : stop if stop >= 0 else len(head)])
            elif b"transfer-encoding: chunked" in head:
                self._send(LENGTH_REQUIRED, close=True)
                return
            total = end + 4 + length
            if len(self.buffer) < total:
                return
            body = bytes(self.buffer[end + 4 : total])
            del self.buffer[:total]
            target = head.split(b" ", 2)[1] if head.count(b" ") >= 2 else b""
            if target.startswith(b"/v1/completions"):
                answer = self.completion if _PROMPT_LIST.search(body) is None else self._batched(body)
            elif target.startswith(b"/v1/models"):
                answer = MODELS
            elif target.startswith((b"/health", b"/ping")):
                answer = HEALTH
            else:
                answer = NOT_FOUND
            close = b"\r\nconnection: close" in head
            if self.latency > 0:
                asyncio.get_running_loop().call_later(self.latency, self._send, answer, close)
            else:
                self._send(answer, close)

    def _batched(self, body: bytes) -> bytes:
        """The canned answer to a prompt list: the canned choice ``n`` times per prompt, numbered over the request."""
        request = json.loads(body)
        shape = (len(request["prompt"]), int(request.get("n") or 1))
        answer = _BATCHED.get((self.completion, shape))
        if answer is None:
            canned = json.loads(self.completion.split(b"\r\n\r\n", 1)[1])
            choice = canned["choices"][0]
            canned["choices"] = [dict(choice, index=index) for index in range(shape[0] * shape[1])]
            usage = canned.get("usage") or {}
            canned["usage"] = {key: value * shape[0] for key, value in usage.items() if isinstance(value, int)}
            answer = _BATCHED[(self.completion, shape)] = _response("200 OK", json.dumps(canned).encode())
        return answer

    def _send(self, answer: bytes, close: bool = False) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(answer)
            if close:
                self.transport.close()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        """Forget the transport, so a late answer is dropped."""
        self.transport = None


def _watch_stdin(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    """Stop the server when standard input closes (the benchmark that started us is gone)."""
    try:
        while os.read(0, 4096):  # os.read, not sys.stdin: no buffer lock left held at interpreter exit
            pass
    except OSError:
        pass
    loop.call_soon_threadsafe(stop.set)


async def serve(host: str, port: int, latency: float, completion: bytes = COMPLETION) -> None:
    """Listen on ``host:port``, print the URL line, and serve until a signal or the end of stdin."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    server = await loop.create_server(
        lambda: CannedHttp(latency, completion), host, port, backlog=1024, reuse_address=True
    )
    bound = server.sockets[0].getsockname()[1]
    print(json.dumps({"url": f"http://{host}:{bound}", "pid": os.getpid()}), flush=True)
    threading.Thread(target=_watch_stdin, args=(loop, stop), daemon=True).start()
    async with server:
        await stop.wait()


def main(argv: Optional[List[str]] = None) -> int:
    """Parse the arguments and serve."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency-ms", type=float, default=0.0, help="service latency per completion (default 0)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port (default 0: a free one)")
    parser.add_argument("--body", help="a file whose bytes are the completion body (default: the canned one)")
    args = parser.parse_args(argv)
    completion = COMPLETION
    if args.body:
        with open(args.body, "rb") as handle:
            completion = _response("200 OK", handle.read())
    asyncio.run(serve(args.host, args.port, args.latency_ms / 1000.0, completion))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
