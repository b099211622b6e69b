"""How sampling results show: the compact ``repr``, the notebook table (``_repr_html_``) and the plain-dict form.

A repr stays one short line whatever the answer holds (a list of 2,000 results stays readable), numbers are
rounded for reading only, and the plain-dict form holds every value exactly, in JSON types (non-finite logprobs
become None). Pure functions of the value types; no I/O.
"""

from __future__ import annotations

import html
import math
from typing import Any, Dict, Iterable, List, Optional, Protocol, Sequence, Tuple, Union

#: The top-k ``(token_id, logprob)`` pairs at one position, best first.
TopKPairs = Sequence[Tuple[int, float]]


class ShownSequence(Protocol):
    """What a view reads of one completion (``lora_sampler.types.GeneratedSequence``)."""

    @property
    def tokens(self) -> Sequence[int]: ...
    @property
    def logprobs(self) -> Sequence[float]: ...
    @property
    def stop_reason(self) -> str: ...
    @property
    def text(self) -> str: ...
    @property
    def matched_stop(self) -> Union[str, int, None]: ...
    @property
    def topk_logprobs(self) -> Optional[Sequence[TopKPairs]]: ...


class ShownUsage(Protocol):
    """What a view reads of an answer's token counts (``lora_sampler.types.Usage``)."""

    @property
    def prompt_tokens(self) -> int: ...
    @property
    def completion_tokens(self) -> int: ...
    def to_dict(self) -> Dict[str, int]: ...


class ShownOutput(Protocol):
    """What a view reads of one answer (``lora_sampler.types.SampleOutput``)."""

    @property
    def sequences(self) -> Sequence[ShownSequence]: ...
    @property
    def prompt_logprobs(self) -> Optional[Sequence[Optional[float]]]: ...
    @property
    def topk_prompt_logprobs(self) -> Optional[Sequence[Optional[TopKPairs]]]: ...
    @property
    def model(self) -> str: ...
    @property
    def usage(self) -> Optional[ShownUsage]: ...


#: Characters of generated text a repr shows.
REPR_TEXT_CHARS = 24
#: Characters of each sequence's text the notebook table shows.
HTML_TEXT_CHARS = 200


def json_number(value: Optional[float]) -> Optional[float]:
    """Return ``value``, or None for NaN and infinities (which JSON cannot hold)."""
    return None if value is None or not math.isfinite(value) else value


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _span(values: Iterable[int]) -> str:
    """``16`` when all equal, else ``12-16``."""
    found = sorted(set(values))
    if not found:
        return "0"
    return str(found[0]) if len(found) == 1 else f"{found[0]}-{found[-1]}"


def total_logprob(sequence: ShownSequence) -> float:
    """Return the sum of a sequence's token logprobs (NaN entries, sent as null, left out)."""
    return math.fsum(lp for lp in sequence.logprobs if not math.isnan(lp))


def sequence_repr(sequence: ShownSequence) -> str:
    """One line: token count, stop reason, summed logprob (2 decimals) and the start of the text."""
    return (
        f"GeneratedSequence(tokens={len(sequence.tokens)}, stop_reason={sequence.stop_reason!r}, "
        f"logprob={total_logprob(sequence):.2f}, text={_short(sequence.text, REPR_TEXT_CHARS)!r})"
    )


def output_repr(output: ShownOutput) -> str:
    """One line: model, number of sequences, their token counts and stop reasons, the start of the first text."""
    sequences = output.sequences
    stops = "/".join(sorted({s.stop_reason for s in sequences})) or "-"
    text = _short(sequences[0].text, REPR_TEXT_CHARS) if sequences else ""
    extra = ", prompt_logprobs" if output.prompt_logprobs is not None else ""
    return (
        f"SampleOutput(model={output.model!r}, n={len(sequences)}, tokens={_span(len(s.tokens) for s in sequences)}, "
        f"stop={stops}{extra}, text={text!r})"
    )


def output_html(output: ShownOutput) -> str:
    """A small table for notebooks: one row per sequence (tokens, stop reason, summed logprob, text)."""
    usage = output.usage
    counts = f"; {usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens" if usage else ""
    rows = "".join(
        f"<tr><td>{i}</td><td>{len(s.tokens)}</td><td>{html.escape(s.stop_reason)}</td>"
        f"<td>{total_logprob(s):.2f}</td><td style='text-align:left'>{html.escape(_short(s.text, HTML_TEXT_CHARS))}"
        "</td></tr>"
        for i, s in enumerate(output.sequences)
    )
    return (
        f"<div><b>SampleOutput</b> from <code>{html.escape(output.model)}</code>: {len(output.sequences)} "
        f"sequence(s){html.escape(counts)}<table><tr><th>#</th><th>tokens</th><th>stop</th><th>logprob</th>"
        f"<th>text</th></tr>{rows}</table></div>"
    )


def sequence_dict(sequence: ShownSequence) -> Dict[str, Any]:
    """The plain-dict form of one sequence: every token id and logprob, the text and why it stopped."""
    return {
        "tokens": list(sequence.tokens),
        "logprobs": [json_number(lp) for lp in sequence.logprobs],
        "text": sequence.text,
        "stop_reason": sequence.stop_reason,
        "matched_stop": sequence.matched_stop,
        **(
            {}
            if sequence.topk_logprobs is None
            else {"topk_logprobs": [[[tid, json_number(lp)] for tid, lp in e] for e in sequence.topk_logprobs]}
        ),
    }


def output_dict(output: ShownOutput) -> Dict[str, Any]:
    """The plain-dict form of an output, in JSON types (the engine's raw ``body`` is left out)."""
    usage = output.usage
    return {
        "model": output.model,
        "sequences": [sequence_dict(s) for s in output.sequences],
        "prompt_logprobs": _numbers(output.prompt_logprobs),
        "topk_prompt_logprobs": (
            None
            if output.topk_prompt_logprobs is None
            else [None if e is None else [[tid, json_number(lp)] for tid, lp in e] for e in output.topk_prompt_logprobs]
        ),
        "usage": None if usage is None else usage.to_dict(),
    }


def _numbers(values: Optional[Sequence[Optional[float]]]) -> Optional[List[Optional[float]]]:
    return None if values is None else [json_number(v) for v in values]


def printable(text: str) -> str:
    """Return ``text`` safe to print on a terminal: control characters (newlines, escapes that move the cursor or
    recolour it, bidirectional overrides) as backslash escapes, everything printable as it is.

    A checkpoint may be named anything a filesystem allows; printed raw, a name with a newline forges a log line and
    one with ``\\x1b[`` rewrites the terminal.
    """
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else char.encode("unicode_escape").decode("ascii") for char in text)
