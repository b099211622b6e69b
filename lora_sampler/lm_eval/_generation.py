"""lm-eval's generation kwargs (``until``, ``max_gen_toks``, ``do_sample``, ``temperature``, ...) as one request.

Every kwarg is forwarded or refused: one this module does not know is an error naming it, never dropped (a dropped
``top_p`` would change the numbers without a word).
"""

from __future__ import annotations

import difflib
from typing import Any, Dict, List, Mapping, Optional, Sequence

from lora_sampler._wire.messages import SAMPLING_FIELDS
from lora_sampler.types import check_count

#: vLLM sampling fields forwarded in the request body as they are (``extra_body``).
VLLM_FIELDS = (
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "length_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "logit_bias",
    "bad_words",
)
#: The generation kwargs lm-eval passes that are read here (``max_tokens`` is local-completions' other name).
HARNESS_FIELDS = ("until", "max_gen_toks", "max_tokens", "do_sample")
#: Every generation kwarg taken.
ACCEPTED = (*HARNESS_FIELDS, *(field for field in SAMPLING_FIELDS if field != "max_tokens"), *VLLM_FIELDS)


def generation_of(kwargs: Optional[Mapping[str, Any]], default_max_tokens: int) -> Dict[str, Any]:
    """Translate lm-eval's generation kwargs into the ``SampleRequest`` keywords besides prompt and model.

    ``until`` (a string or a list) becomes the stop strings; ``max_gen_toks`` (or ``max_tokens``) the most tokens
    generated (default ``default_max_tokens``); ``do_sample=False`` without a temperature is greedy, as is no
    ``do_sample`` and no temperature (local-completions' default), and ``do_sample=True`` without one samples at
    temperature 1. ``temperature``, ``top_p``, ``top_k`` and ``seed`` go as they are, vLLM's other sampling fields
    (``VLLM_FIELDS``) in the body.

    Raises:
        ValueError: a kwarg that is not taken (named, with the one meant when it is close), or a bad value.
    """
    given = dict(kwargs or {})
    unknown = [name for name in given if name not in ACCEPTED]
    if unknown:
        raise ValueError(
            f"generation kwarg(s) {', '.join(map(repr, unknown))} not forwarded to the engine"
            f"{''.join(meant(name, ACCEPTED) for name in unknown)}; lora-sampler takes {', '.join(ACCEPTED)}"
        )
    max_tokens = given.pop("max_gen_toks", given.pop("max_tokens", default_max_tokens))
    check_count("max_gen_toks", max_tokens, 1)
    do_sample = given.pop("do_sample", None)
    given.setdefault("temperature", 1.0 if do_sample else 0.0)
    fields: Dict[str, Any] = {"max_tokens": max_tokens, "stop": _stop_strings(given.pop("until", None))}
    extra = {name: given.pop(name) for name in VLLM_FIELDS if name in given}
    if extra:
        fields["extra_body"] = extra
    fields.update(given)  # temperature, top_p, top_k, seed
    return fields


def meant(name: str, choices: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` for the choice closest to a name that is not one, or nothing when none is close."""
    hints = difflib.get_close_matches(name, choices, n=1)
    return f" (did you mean {hints[0]!r}?)" if hints else ""


def _stop_strings(until: Any) -> Optional[List[str]]:
    if until is None:
        return None
    stops = [until] if isinstance(until, str) else until
    if not isinstance(stops, (list, tuple)) or not all(isinstance(stop, str) for stop in stops):
        raise ValueError(f"until must be a string or a list of strings, got {until!r}")
    return [stop for stop in stops if stop] or None
