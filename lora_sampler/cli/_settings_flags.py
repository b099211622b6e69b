"""The command line's flags for ``SweepSettings`` fields, generated from the fields, and the settings read back.

A field's ``Setting`` (its metadata) names its flag, help, placeholder and how its text is read; ``add_flags`` adds
the flags of the fields it is given (``sweep`` takes every field that has a flag; ``sample`` and ``score`` share the
sampling and pacing ones), and ``settings_from`` builds the one ``SweepSettings`` from the parsed flags, so its checks
are the command line's and their messages name the flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any, Callable, Dict, Iterable, List

from lora_sampler import _json
from lora_sampler.batch._settings import SweepSettings, setting_of
from lora_sampler.cli._parser import UsageError

#: The fields of ``SweepSettings`` every command that samples takes as flags.
SAMPLING_FIELDS = (
    "num_samples",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "prompt_logprobs",
    "extra_body",
)
#: The fields every command that runs many requests takes as flags.
PACE_FIELDS = ("max_outage", "prompts_per_request", "mix_adapters")


def json_object(value: str) -> Dict[str, Any]:
    """Parse a flag that takes a JSON object (``--extra-body``, ``--lm-eval-args``); which fields the object may hold
    is its setting's to check (``SweepSettings``: ``settings_from`` reports it under the flag). Read strictly, as
    every engine answer is: NaN and Infinity are no JSON, and no request could carry them."""
    try:
        parsed = _json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"takes a JSON object, as its help shows ({exc})") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"takes a JSON object (a dict of fields), got {type(parsed).__name__}")
    return parsed


#: A check's ``None (the measured defaults), ``: the Python spelling of a flag left out.
_PYTHON_NONE = re.compile(r"\bNone \(([^)]*)\),? ")

#: How a flag's text becomes a value, by the ``Setting.value`` of its field.
_READERS: Dict[Any, Callable[[str], Any]] = {
    int: int,
    float: float,
    dict: json_object,
}


#: The fields of ``SweepSettings`` by name.
_FIELDS = {item.name: item for item in dataclasses.fields(SweepSettings)}
#: The flag of each field that has one, in field order.
FLAGS = {name: flag for name, item in _FIELDS.items() if (flag := setting_of(item).flag_of(name)) is not None}


def flag_fields() -> List[str]:
    """The names of the fields that have a flag, in field order."""
    return list(FLAGS)


def add_flags(parser: argparse.ArgumentParser, names: Iterable[str]) -> None:
    """Add the flag of each named field to ``parser``: its help, placeholder, reader and default from the field."""
    for name in names:
        item, about = _FIELDS[name], setting_of(_FIELDS[name])
        default = item.default if about.cli_default is None else about.cli_default
        options: Dict[str, Any] = {"dest": name, "help": _snake_to_flags(about.help).replace("%", "%%")}
        if about.value is None and isinstance(default, bool):
            options["action"] = "store_true"
        elif about.value is list:
            options.update(action="append", metavar=about.metavar)
        elif default is dataclasses.MISSING:
            options.update(required=True, metavar=about.metavar)
        else:
            options.update(type=_READERS.get(about.value, str), default=default, metavar=about.metavar)
        parser.add_argument(FLAGS[name], **options)


def settings_from(args: argparse.Namespace, **given: Any) -> SweepSettings:
    """Return the ``SweepSettings`` of the parsed flags (a field whose flag the command lacks keeps its default).

    ``sweep`` takes every setting's flag; ``sample`` and ``score`` take the sampling and pacing ones and give their
    ``--output`` as ``output_dir`` (``given``), so their flags are checked by the same value, in the same words.
    One bound is the command line's own: an unattended job's outage hold is finite (Python's ``max_outage`` may be
    inf).

    Raises:
        UsageError: a bad value or combination (a ``ValueError``); the message names the flags.
    """
    if args.max_outage == float("inf"):  # the value checks the rest (>= 0), as for Python
        raise UsageError("--max-outage takes a finite number of seconds on the command line (0 stops at once), got inf")
    flags = vars(args)  # argparse's documented dict view of its Namespace
    values = {name: flags[name] for name in flag_fields() if name in flags}
    try:
        return SweepSettings(**{**values, **given})
    except (TypeError, ValueError) as error:
        raise UsageError(flags_named(str(error))) from None


def flags_named(message: str) -> str:
    """``message`` with the settings it names spelled as their flags (``keep_loaded`` -> ``--keep-loaded``), and
    Python's ``None (what it means)`` said as the flag left out."""
    first, _, rest = message.partition(" ")
    if first in FLAGS:
        message = f"{FLAGS[first]} {rest}"
    none = _PYTHON_NONE.search(message)
    if none is not None:
        message = f"{message[: none.start()]}{message[none.end() :]}; leave the flag out for {none[1]}"
    return _snake_to_flags(message)


def _snake_to_flags(text: str) -> str:
    """``text`` with every setting named in snake case (``idle_timeout``, or Python's keyword ``num_samples=``) spelled
    as its flag (``--num-samples``); a name quoted (a line's own ``"extra_body"``) or inside a call
    (``SamplingParams(max_tokens=...)``) is left as it is."""
    return re.sub(
        r"(?<![-\w(\"'])([a-z]+(?:_[a-z]+)+)\b(?:=(?![^\s;,)]))?", lambda match: FLAGS.get(match[1], match[0]), text
    )
