"""How a checkpoint sweep runs, in one value: ``SweepSettings``.

Each field is one setting, with its help text and its ``lora-sampler sweep`` flag in the field's metadata
(``Setting``): the command line's flags are generated from the fields, ``lora_sampler.sweep(**overrides)`` takes
their names, and the guide's table lists them (a test checks it does). A setting therefore reaches the command line,
the Python call and the docs together, and it is checked once, here, whichever way it came.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from lora_sampler._client.fanout import checked_prompts_per_request
from lora_sampler._defaults import (
    DEFAULT_CHECKPOINT_TIMEOUT,
    DEFAULT_FAIL_FAST,
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_SCORING_PROMPTS_PER_REQUEST,
    DEFAULT_SETTLE,
    DEFAULT_WINDOW,
    MAX_PROMPTS_PER_REQUEST,
)
from lora_sampler._wire.messages import validated_extra_body
from lora_sampler.batch._lines import LineDefaults
from lora_sampler.batch._score import ScoreStep
from lora_sampler.batch._steps import SampleStep, SweepInput
from lora_sampler.types import SamplingParams, StopSpec, check_count, checked_seconds, sampling_params_from

#: The metadata key of a field's ``Setting``.
SETTING_KEY = "lora_sampler.setting"
#: ``--max-outage`` on the command line: an unattended job waits out a restart or redeploy of the engine.
CLI_MAX_OUTAGE = 600.0
_SAMPLING = SamplingParams()
#: The lm-eval settings besides the tasks.
_LM_EVAL_EXTRAS = ("lm_eval_include_path", "lm_eval_limit", "lm_eval_num_fewshot", "lm_eval_args")


@dataclass(frozen=True)
class Setting:
    """What a ``SweepSettings`` field says about itself: its help text and its flag.

    Attributes:
        help: One sentence for ``--help``, the docstring and the guide's table.
        cli: Whether the setting has a ``lora-sampler`` flag, named after the field (``idle_timeout`` ->
            ``--idle-timeout``); False: a Python-only setting (a value no flag can spell).
        metavar: The flag's placeholder.
        value: How the flag's text becomes a value: ``int``, ``float``, ``dict`` (a JSON object) or ``list`` (the
            flag repeats); None: a switch (a bool field) or text.
        cli_default: The command line's default where it differs from the field's (None: the field's).
    """

    help: str
    cli: bool = True
    metavar: Optional[str] = None
    value: Optional[type] = None
    cli_default: Any = None

    def flag_of(self, name: str) -> Optional[str]:
        """The flag of the field ``name`` (None: Python only)."""
        return "--" + name.replace("_", "-") if self.cli else None


def _setting(default: Any, **about: Any) -> Any:
    """A ``SweepSettings`` field with its default (``dataclasses.MISSING``: none) and its ``Setting`` (``about``) as
    its metadata."""
    return field(default=default, metadata={SETTING_KEY: Setting(**about)})


def setting_of(item: dataclasses.Field[Any]) -> Setting:
    """The ``Setting`` of a ``SweepSettings`` field."""
    about = item.metadata[SETTING_KEY]
    assert isinstance(about, Setting)
    return about


@dataclass(frozen=True)
class SweepSettings:
    """Every setting of a checkpoint sweep (the flags of ``lora-sampler sweep``; see docs/guides/sweeps.md).

    Only ``output_dir`` has no default. Each field's help is in its ``Setting`` and the guide's table; a bad
    value raises ``ValueError`` or ``TypeError`` naming the field, before any request.
    """

    output_dir: str = _setting(
        dataclasses.MISSING, metavar="DIR", help="where DIR/<adapter>.jsonl per checkpoint and DIR/sweep.jsonl go"
    )
    # -- what runs on each checkpoint
    score: bool = _setting(
        False,
        help="score every line under each checkpoint instead of sampling it (lines {id, prompt, completion?}, as "
        "score takes them); the reports then give mean_logprob per scored token and mean_sum per line",
    )
    num_samples: int = _setting(1, value=int, metavar="N", help="completions per prompt (default: 1)")
    max_tokens: Optional[int] = _setting(
        None, value=int, metavar="N", help=f"tokens per completion (default: {_SAMPLING.max_tokens})"
    )
    temperature: Optional[float] = _setting(
        None, value=float, metavar="T", help=f"sampling temperature (default: {_SAMPLING.temperature:g})"
    )
    top_p: Optional[float] = _setting(
        None, value=float, metavar="P", help=f"nucleus mass in (0, 1] (default: {_SAMPLING.top_p:g})"
    )
    top_k: Optional[int] = _setting(
        None, value=int, metavar="K", help=f"top-k cut-off; -1 disables it (default: {_SAMPLING.top_k})"
    )
    seed: Optional[int] = _setting(None, value=int, metavar="N", help="sampling seed (default: none)")
    stop: StopSpec = _setting(
        None,
        value=list,
        metavar="TEXT",
        help="a stop string (repeat the flag for several; a line's own stop may also hold token ids)",
    )
    prompt_logprobs: bool = _setting(False, help="also return the prompt's logprobs")
    extra_body: Optional[Mapping[str, Any]] = _setting(
        None,
        value=dict,
        metavar="JSON",
        help='further fields of every request body, as vLLM takes them, e.g. {"repetition_penalty": 1.1, '
        '"min_tokens": 4}; a line\'s own "extra_body" object overrides its keys',
    )
    sampling_params: Optional[SamplingParams] = _setting(
        None, cli=False, help="the sampling fields as one SamplingParams, instead of max_tokens, temperature, ..."
    )
    # -- lm-evaluation-harness tasks on each checkpoint (the [lm-eval] extra)
    lm_eval_tasks: Optional[Sequence[str]] = _setting(
        None,
        metavar="T1,T2",
        help="run these lm-eval tasks on each checkpoint instead of lines (comma-separated): lm-eval's results "
        "JSON per checkpoint under output_dir/lm-eval/, every number it reports as <task>/<key> in sweep.jsonl, "
        "the table and the plot (needs lora_sampler[lm-eval])",
    )
    lm_eval_include_path: Optional[str] = _setting(
        None, metavar="DIR", help="a folder of lm-eval task YAMLs of your own"
    )
    lm_eval_limit: Optional[float] = _setting(
        None,
        value=float,
        metavar="N",
        help="lm-eval's --limit: the first N documents of each task (below 1: a fraction)",
    )
    lm_eval_num_fewshot: Optional[int] = _setting(
        None, value=int, metavar="K", help="lm-eval's --num_fewshot: K examples per prompt"
    )
    lm_eval_args: Optional[Mapping[str, Any]] = _setting(
        None,
        value=dict,
        metavar="JSON",
        help='what else lm-eval\'s simple_evaluate takes, as a JSON object, e.g. {"gen_kwargs": "temperature=0", '
        '"apply_chat_template": true, "log_samples": true}',
    )
    # -- which checkpoints, when
    window: int = _setting(
        DEFAULT_WINDOW,
        value=int,
        metavar="N",
        help="checkpoints with requests in flight at once: the next checkpoint is published and loaded while the "
        f"last rows of the one before run, so the engine does not idle between them (default: {DEFAULT_WINDOW}; "
        "1 runs them strictly one after the other)",
    )
    watch: bool = _setting(
        False,
        help="follow a run that is still training: look again for new checkpoints until idle_timeout passes with "
        'nothing new, or the manifest\'s "final": true checkpoint is done',
    )
    idle_timeout: float = _setting(
        DEFAULT_IDLE_TIMEOUT,
        value=float,
        metavar="SECONDS",
        help=f"a watch ends after this long with nothing new (default: {DEFAULT_IDLE_TIMEOUT:g})",
    )
    settle: float = _setting(
        DEFAULT_SETTLE,
        value=float,
        metavar="SECONDS",
        help=f"a checkpoint is taken once unchanged this long and complete (default: {DEFAULT_SETTLE:g})",
    )
    checkpoint_timeout: float = _setting(
        DEFAULT_CHECKPOINT_TIMEOUT,
        value=float,
        metavar="SECONDS",
        help="wait at most this long for one checkpoint (absent, or still being written) from when it was first "
        f"seen, then record it as missing or incomplete and go on (default: {DEFAULT_CHECKPOINT_TIMEOUT:g})",
    )
    allow_outside_paths: bool = _setting(
        False, help="take manifest sampler paths outside the manifest's folder (absolute paths elsewhere, ..)"
    )
    restart: bool = _setting(
        False,
        help="drop what output_dir holds (the ledger and every checkpoint's answers) and evaluate every checkpoint "
        "again; needed to sweep into a folder with other settings (sampling, scoring, prompts) than it remembers",
    )
    keep_loaded: bool = _setting(False, help="leave finished adapters loaded on the engine")
    delete_retired: bool = _setting(
        False,
        help="delete a finished adapter's folder once its unload is confirmed (unless another run holds a lease on "
        "it); cannot go with keep_loaded",
    )
    # -- how the client and the store are used
    max_outage: float = _setting(
        0.0,
        value=float,
        metavar="SECONDS",
        cli_default=CLI_MAX_OUTAGE,
        help="wait this long for an engine that went away (crash, restart, no router worker) before stopping; "
        f"0 stops at once (default: 0 in Python, {CLI_MAX_OUTAGE:g} on the command line)",
    )
    fail_fast: int = _setting(
        DEFAULT_FAIL_FAST,
        value=int,
        metavar="N",
        help="stop a checkpoint's job after this many failures in a row that are not a line's own "
        f"(default: {DEFAULT_FAIL_FAST})",
    )
    prompts_per_request: Optional[int] = _setting(
        None,
        value=int,
        metavar="N",
        help="lines of one model and settings sent together in one completion request (chat lines always alone); "
        f"1 sends each alone, at most {MAX_PROMPTS_PER_REQUEST} (default: measured, "
        f"{DEFAULT_SCORING_PROMPTS_PER_REQUEST} for scoring and for short generations, fewer for long ones)",
    )
    mix_adapters: bool = _setting(
        False,
        help="let scoring requests (prompt logprobs) share the engine with other models' requests; by default they "
        "are kept apart, as some engines score with the wrong adapter in mixed batches (doctor --scoring tells)",
    )
    storage_options: Optional[Mapping[str, Any]] = _setting(
        None,
        cli=False,
        help="options of the storage library (fsspec) for checkpoint URLs, for the sweep's listings and "
        "publishing, held to the client's timeout (default: the client's storage_options)",
    )

    def __post_init__(self) -> None:
        if not isinstance(self.output_dir, (str, os.PathLike)):
            raise TypeError(f"output_dir must be a folder path, got {type(self.output_dir).__name__}")
        object.__setattr__(self, "output_dir", os.fspath(self.output_dir))
        for name in ("window", "num_samples", "fail_fast"):
            check_count(name, getattr(self, name), 1)
        for name in ("idle_timeout", "settle", "max_outage", "checkpoint_timeout"):
            checked_seconds(getattr(self, name), name)
        checked_prompts_per_request(self.prompts_per_request)
        if self.keep_loaded and self.delete_retired:
            raise ValueError("delete_retired deletes the folders of unloaded adapters; it cannot go with keep_loaded")
        if self.extra_body is not None:
            validated_extra_body(self.extra_body)
        self._check_lm_eval()
        self._check_score()

    def _check_lm_eval(self) -> None:
        """``lm_eval_tasks`` as a tuple of names ("T1,T2" is two); the other lm_eval_ settings need it."""
        tasks = self.lm_eval_tasks
        if tasks is None:
            given = [name for name in _LM_EVAL_EXTRAS if getattr(self, name) is not None]
            if given:
                raise TypeError(f"{', '.join(given)} apply to lm_eval_tasks; name the tasks to run with lm_eval_tasks")
            return
        names = tuple(name.strip() for name in tasks.split(",")) if isinstance(tasks, str) else tuple(tasks)
        if not names or not all(isinstance(name, str) and name for name in names):
            raise ValueError(f"lm_eval_tasks must name tasks (T1,T2), got {tasks!r}")
        object.__setattr__(self, "lm_eval_tasks", names)
        if self.lm_eval_args is not None and not isinstance(self.lm_eval_args, Mapping):
            raise TypeError(f"lm_eval_args must be a mapping of simple_evaluate's arguments, got {self.lm_eval_args!r}")

    def _check_score(self) -> None:
        """The sampling fields make one ``SamplingParams``; ``score`` goes with none of them, nor with lm-eval."""
        params = self.sampling()  # checks the sampling fields
        if not self.score:
            return
        if self.lm_eval_tasks is not None:
            raise TypeError("score scores lines; lm_eval_tasks runs lm-eval's tasks instead of lines")
        sampled = {"num_samples": self.num_samples != 1, "sampling settings": params != _SAMPLING}
        sampled.update(extra_body=self.extra_body is not None, prompt_logprobs=self.prompt_logprobs)
        given = [name for name, is_set in sampled.items() if is_set]
        if given:
            raise TypeError(f"score scores each line; {', '.join(given)} apply to sampling only")

    @classmethod
    def of(cls, settings: Optional[SweepSettings] = None, **overrides: Any) -> SweepSettings:
        """Return ``settings`` (or the defaults) with ``overrides`` (field names) applied and checked.

        Raises:
            TypeError: an override that is not a setting (the message suggests the closest), or no ``output_dir``.
            ValueError: a bad value, naming the setting.
        """
        names = [item.name for item in dataclasses.fields(cls)]
        for name in overrides:
            if name not in names:
                close = difflib.get_close_matches(name, names, n=1)
                hint = f"; did you mean {close[0]}?" if close else f"; the settings are {', '.join(names)}"
                raise TypeError(f"sweep() got an unknown setting {name!r}{hint}")
        if isinstance(settings, (str, os.PathLike)):  # sweep(client, checkpoints, requests, "evals")
            raise TypeError(f"settings= takes a SweepSettings; pass the output folder as output_dir={settings!r}")
        if settings is not None:
            if not isinstance(settings, SweepSettings):
                raise TypeError(f"settings= takes a SweepSettings, got {type(settings).__name__}")
            return dataclasses.replace(settings, **overrides)
        if "output_dir" not in overrides:
            raise TypeError("sweep() needs output_dir= (where the outputs and sweep.jsonl go), or settings=")
        return cls(**overrides)

    def sampling(self) -> SamplingParams:
        """The sampling parameters every line gets unless it sets its own."""
        params = sampling_params_from(
            self.sampling_params,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=self.stop,
        )
        return params or _SAMPLING

    def step(self, requests: Optional[SweepInput]) -> SampleStep:
        """The evaluation of each checkpoint: score or sample ``requests`` (None: an evaluator sends its own)."""
        if requests is None:
            return SampleStep([])
        return ScoreStep(requests) if self.score else SampleStep(requests, self.line_defaults())

    def line_defaults(self, **more: Any) -> LineDefaults:
        """What every sampled line gets unless it sets its own (``more``: the other ``LineDefaults`` fields, such as
        the model ``lora-sampler sample`` names for every line)."""
        return LineDefaults(
            num_samples=self.num_samples,
            sampling_params=self.sampling(),
            prompt_logprobs=self.prompt_logprobs,
            extra_body=self.extra_body,
            **more,
        )
