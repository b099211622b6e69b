"""Client CPU per scoring answer: ``sample(..., prompt_logprobs=True, topk_prompt_logprobs=k)`` versus ``json.loads``.

A canned engine in its own process (``_canned_engine.py --body``) answers every completion with the same vLLM body:
one generated token, and prompt logprobs at N positions with the top k at each (vLLM's shape: ``None`` first, then
``{"<id>": {"logprob", "rank", "decoded_token"}}`` per position, the prompt token added when it ranks below k). In
this one process, rounds alternate the client's call (send, read, decode, check, each prompt token's logprob read),
the same call followed by reading every position's top-k pairs, and ``json.loads`` of the same bytes; the medians of
CPU time per answer are reported, and their ratios. The engine's CPU
is not counted. The faster decoders (orjson, msgspec) are timed alone beside them when installed.

    python benchmarks/bench_scoring.py [--quick] [--rounds 5] [--positions 100 2000 8000] [--topk 0 5 20]
                                       [--name bench_scoring] [--no-fast]

``--no-fast`` hides msgspec from the client (and from the msgspec column), as without the ``[fast]`` extra.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

if "--no-fast" in sys.argv:  # before _common imports lora_sampler: `import msgspec` raises ImportError from here on
    sys.modules["msgspec"] = None  # type: ignore[assignment]

import _canned_engine  # after the decoder choice above
import _common

MODEL = "bench/base-model"
#: The issue's target: client CPU per answer of the 2,000 x top-20 answer at most this many json.loads.
TARGET_RATIO = 0.85
TARGET_CASE = (2000, 20)
#: Measured CPU seconds per side, per case and round (the batch is sized from the warm-up).
DEFAULT_SECONDS = 0.5


def scoring_body(positions: int, k: int, seed: int = 0) -> Tuple[bytes, List[int]]:
    """Return a vLLM completion body with ``positions`` prompt logprobs of top ``k``, and its prompt token ids."""
    rng = random.Random(f"{positions}|{k}|{seed}")
    prompt = [rng.randrange(4, 32000) for _ in range(positions)]
    entries: List[Optional[Dict[str, Any]]] = [None]
    for token in prompt[1:]:
        values = sorted((-rng.uniform(0.001, 12.0) for _ in range(k + 1)), reverse=True)
        rank = rng.randint(1, k + 3)
        entry: Dict[str, Any] = {
            str(token): {"logprob": values[min(rank, k + 1) - 1], "rank": rank, "decoded_token": " w"}
        }
        for place in range(1, k + 1):
            other = rng.randrange(4, 32000)
            entry.setdefault(str(other), {"logprob": values[place - 1], "rank": place, "decoded_token": " x"})
        entries.append(entry)
    body = json.loads(_canned_engine.completion_body())  # the canned completion, its one choice cut to one token
    choice = body["choices"][0]
    choice.update(text=" t", token_ids=[777], prompt_logprobs=entries, prompt_token_ids=prompt)
    choice["logprobs"] = {
        "text_offset": [0],
        "token_logprobs": [-0.5],
        "tokens": [" t"],
        "top_logprobs": [{" t": -0.5}],
    }
    body.update(model=MODEL, usage={"prompt_tokens": positions, "total_tokens": positions + 1, "completion_tokens": 1})
    return json.dumps(body).encode(), prompt


def _cpu_per_call(run: Callable[[], Any], seconds: float) -> float:
    """Return the CPU seconds per call of ``run`` over a batch sized to take about ``seconds`` of CPU."""
    start = time.process_time()
    run()
    once = max(time.process_time() - start, 1e-6)
    calls = max(3, min(200, int(seconds / once)))
    gc.collect()
    start = time.process_time()
    for _ in range(calls):
        run()
    return (time.process_time() - start) / calls


def _decoders() -> Dict[str, Callable[[bytes], Any]]:
    found: Dict[str, Callable[[bytes], Any]] = {"json.loads": json.loads}
    try:
        import orjson

        found["orjson.loads"] = orjson.loads
    except ImportError:
        pass
    try:
        import msgspec

        found["msgspec.json.decode"] = msgspec.json.decode
    except ImportError:
        pass
    return found


def measure_case(positions: int, k: int, rounds: int, seconds: float) -> Dict[str, Any]:
    """Measure one (positions, k) case: the client against json.loads, side by side, ``rounds`` rounds."""
    from lora_sampler import SamplerClient

    body, prompt = scoring_body(positions, k)
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        handle.write(body)
    decoders = _decoders()
    samples: Dict[str, List[float]] = {"client": [], "client + read top-k": [], **{name: [] for name in decoders}}
    try:
        server = _common.ServerProcess(
            [sys.executable, os.path.join(_common.HERE, "_canned_engine.py"), "--body", handle.name]
        )
        with server, SamplerClient(server.url, max_workers=1, timeout=(10.0, 120.0)) as client:

            def call() -> Any:
                output = client.sample(prompt, base_model=MODEL, prompt_logprobs=True, topk_prompt_logprobs=k)
                assert output.prompt_logprobs is not None and len(output.prompt_logprobs) == positions
                return output

            def call_and_read_topk() -> Any:
                output = call()
                if k:  # every position's top-k pairs read (a lazy view pays for them here)
                    assert output.topk_prompt_logprobs is not None
                    assert sum(1 for entry in output.topk_prompt_logprobs if entry) == positions - 1
                return output

            call_and_read_topk()  # connect, warm up
            runners: Dict[str, Callable[[], Any]] = {"client": call, "client + read top-k": call_and_read_topk}
            runners.update({name: (lambda decode=decode: decode(body)) for name, decode in decoders.items()})
            for round_index in range(rounds):
                names = list(runners) if round_index % 2 == 0 else list(reversed(runners))
                for name in names:
                    samples[name].append(_cpu_per_call(runners[name], seconds))
    finally:
        os.unlink(handle.name)
    medians = {name: _common.median(values) for name, values in samples.items()}
    return {
        "positions": positions,
        "topk": k,
        "body_bytes": len(body),
        "samples_s": samples,
        "median_ms": {name: value * 1000 for name, value in medians.items()},
        "client_vs_json_loads": medians["client"] / medians["json.loads"],
        "client_read_topk_vs_json_loads": medians["client + read top-k"] / medians["json.loads"],
    }


def client_decoder() -> str:
    """Return the decoder the checkout's client uses (before the change there was only the standard library's)."""
    try:
        from lora_sampler import _json
    except ImportError:
        return "json (stdlib)"
    if not os.path.abspath(_json.__file__).startswith(_common.REPO + os.sep):  # an editable install's, not ours
        return "json (stdlib)"
    return str(_json.DECODER_NAME)


def main(argv: Optional[List[str]] = None) -> int:
    """Run every case, print the table, write the results JSON; exit 1 when the target case misses."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 0.2 s (a smoke run)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=DEFAULT_SECONDS)
    parser.add_argument("--positions", type=int, nargs="+", default=[100, 2000, 8000])
    parser.add_argument("--topk", type=int, nargs="+", default=[0, 5, 20])
    parser.add_argument("--name", default="bench_scoring", help="results file stem (e.g. bench_scoring_before)")
    parser.add_argument(
        "--no-fast", action="store_true", help="hide msgspec from the client (the standard library decodes)"
    )
    args = parser.parse_args(argv)
    rounds, seconds = (2, 0.2) if args.quick else (args.rounds, args.seconds)
    started = time.monotonic()
    cases = [measure_case(n, k, rounds, seconds) for n in args.positions for k in args.topk]
    headers = ["positions", "top-k", "MB", "client ms", "json.loads ms", "client / json.loads", "+ read top-k ms"]
    headers += ["+ read / json.loads", "orjson ms", "msgspec ms"]
    rows = [
        [
            case["positions"],
            case["topk"],
            case["body_bytes"] / 1e6,
            case["median_ms"]["client"],
            case["median_ms"]["json.loads"],
            case["client_vs_json_loads"],
            case["median_ms"]["client + read top-k"],
            case["client_read_topk_vs_json_loads"],
            case["median_ms"].get("orjson.loads", float("nan")),
            case["median_ms"].get("msgspec.json.decode", float("nan")),
        ]
        for case in cases
    ]
    target = [c for c in cases if (c["positions"], c["topk"]) == TARGET_CASE]
    ok = None if not target else target[0]["client_vs_json_loads"] <= TARGET_RATIO
    from lora_sampler._version import __version__

    decoder = client_decoder()
    print(_common.table(headers, rows))
    print(f"\nclient decoder: {decoder}; target {TARGET_CASE}: client <= {TARGET_RATIO} x json.loads: ", end="")
    print(_common.verdict(ok))
    results = {
        "command": " ".join(["python", "benchmarks/bench_scoring.py", *(argv if argv is not None else sys.argv[1:])]),
        "rounds": rounds,
        "seconds_per_side": seconds,
        "decoder": decoder,
        "lora_sampler": __version__,
        "cases": cases,
        "target": {"case": TARGET_CASE, "max_ratio": TARGET_RATIO, "verdict": _common.verdict(ok)},
        "markdown": _common.markdown_table(headers, rows),
        "wall_s": time.monotonic() - started,
        "machine": _common.machine(),
    }
    path = os.path.join(_common.RESULTS_DIR, f"{args.name}.json")
    with open(path, "w") as out:
        json.dump(results, out, indent=1)
    print(f"wrote {path}")
    return 0 if ok is not False else 1


if __name__ == "__main__":
    raise SystemExit(main())
