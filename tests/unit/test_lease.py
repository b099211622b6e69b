"""Adapter-folder leases: a folder another process holds a lease on is never deleted; a killed holder lets go.

Holders are real processes (the lease is a ``flock``, which the kernel drops when its process dies, even on SIGKILL).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict

import pytest

from lora_sampler._adapters.lease import LEASE_FOLDER, hold, lease_path, leased, remove_if_unleased

HOLDER = """
import sys, time
from lora_sampler._adapters.lease import hold
lease = hold(sys.argv[1], sys.argv[2])
print("held", lease.held, flush=True)
time.sleep(600)
"""
REPO = Path(__file__).resolve().parents[2]


def adapter_folder(base: Path, name: str) -> Path:
    folder = base / name
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text("{}")
    return folder


def start_holder(base: Path, name: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(base), name], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "held True"
    return proc


def test_a_folder_leased_by_another_process_is_kept_until_that_process_dies(tmp_path: Path) -> None:
    """Two sweeps of one run: the one still sampling holds a lease; the other's clean-up keeps the folder."""
    folder = adapter_folder(tmp_path, "step-1-abc")
    holder = start_holder(tmp_path, "step-1-abc")
    try:
        assert leased(tmp_path, "step-1-abc") is True
        assert remove_if_unleased(tmp_path, "step-1-abc") is False
        assert folder.is_dir()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert leased(tmp_path, "step-1-abc") is False  # the kernel released the killed holder's lock
    assert remove_if_unleased(tmp_path, "step-1-abc") is True
    assert not folder.exists()
    assert not Path(lease_path(tmp_path, "step-1-abc")).exists()


def test_own_lease_counts_until_released(tmp_path: Path) -> None:
    """Within one process a held lease also keeps the folder (each lease is its own open file)."""
    folder = adapter_folder(tmp_path, "a")
    lease = hold(tmp_path, "a")
    assert lease.held and remove_if_unleased(tmp_path, "a") is False and folder.is_dir()
    lease.release()
    lease.release()  # idempotent
    assert remove_if_unleased(tmp_path, "a") is True and not folder.exists()


def test_many_holders_share_and_the_last_release_frees(tmp_path: Path) -> None:
    adapter_folder(tmp_path, "a")
    first, second = hold(tmp_path, "a"), hold(tmp_path, "a")
    first.release()
    assert remove_if_unleased(tmp_path, "a") is False
    second.release()
    assert remove_if_unleased(tmp_path, "a") is True


def test_missing_folder_counts_as_removed(tmp_path: Path) -> None:
    assert remove_if_unleased(tmp_path, "never-there") is True


def test_lease_folder_is_hidden_and_names_are_checked(tmp_path: Path) -> None:
    """The lease folder starts with a dot (no adapter name does), and a name cannot escape it."""
    with hold(tmp_path, "x") as lease:
        assert Path(lease.path).parent == tmp_path / LEASE_FOLDER
    for bad in ("..", "../x", "a/b", ".hidden"):
        with pytest.raises(ValueError):
            hold(tmp_path, bad)
        with pytest.raises(ValueError):
            remove_if_unleased(tmp_path, bad)


def race_once(base: Path, name: str) -> Dict[str, Any]:
    """One lease and one removal started together; what the holder saw under its lease."""
    folder = adapter_folder(base, name)
    seen: Dict[str, Any] = {}

    def take() -> None:
        lease = hold(base, name)
        seen["present"] = folder.is_dir()
        time.sleep(0.002)
        seen["present_after"] = folder.is_dir()
        lease.release()

    def remove() -> None:
        seen["removed"] = remove_if_unleased(base, name)

    threads = [threading.Thread(target=take), threading.Thread(target=remove)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    return seen


def test_a_holder_racing_a_removal_never_sees_its_folder_deleted_under_its_lease(tmp_path: Path) -> None:
    """Removal and lease race: a holder that saw the folder under its lease still sees it (the registry re-checks
    the folder once it holds the lease, and publishes again when a clean-up was first)."""
    for round_number in range(30):
        seen = race_once(tmp_path, f"a{round_number}")
        if seen["present"]:
            assert seen["present_after"]
        assert seen["removed"] is (not (tmp_path / f"a{round_number}").exists())


def test_a_forked_child_does_not_keep_its_parents_lease(tmp_path: Path) -> None:
    """A fork-started child (multiprocessing's default on Linux) drops the inherited lease: the parent's lease still
    protects the folder while the parent holds it, and once the parent releases, the folder can go."""
    adapter_folder(tmp_path, "a")
    lease = hold(tmp_path, "a")
    checked_read, checked_write = os.pipe()
    go_read, go_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        kept = remove_if_unleased(tmp_path, "a") is False and not lease.held
        os.write(checked_write, b"1" if kept else b"0")
        os.read(go_read, 1)  # stay alive while the parent releases and removes
        os._exit(0)
    try:
        assert os.read(checked_read, 1) == b"1"  # the parent's lease held against the child's clean-up
        lease.release()
        assert remove_if_unleased(tmp_path, "a") is True  # the living child holds nothing
    finally:
        os.write(go_write, b"x")
        _, status = os.waitpid(pid, 0)
        for fd in (checked_read, checked_write, go_read, go_write):
            os.close(fd)
    assert os.WEXITSTATUS(status) == 0


def test_the_last_release_leaves_no_trace_in_the_resolver_folder(tmp_path: Path) -> None:
    """Runs that ended leave no lease file and no lease folder behind; one still holding keeps its own."""
    first, second, other = hold(tmp_path, "a"), hold(tmp_path, "a"), hold(tmp_path, "b")
    first.release()
    assert Path(first.path).exists()  # the second holder still holds it
    second.release()
    assert not Path(first.path).exists() and Path(other.path).exists()
    other.release()
    assert os.listdir(tmp_path) == []


def test_a_lease_folder_removed_inside_makedirs_is_made_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Another lease's last release removes the empty lease folder between makedirs' mkdir ("exists") and its own
    check (gone), and makedirs raises FileExistsError (seen in CI: the adapter folder was then kept as "leased")."""
    real_makedirs = os.makedirs
    vanished = []

    def folder_removed_mid_call(name: str, mode: int = 0o777, exist_ok: bool = False) -> None:
        if not vanished:  # what the standard library raises in that interleaving
            vanished.append(name)
            raise FileExistsError(17, "File exists", name)
        real_makedirs(name, mode, exist_ok)

    monkeypatch.setattr(os, "makedirs", folder_removed_mid_call)
    adapter_folder(tmp_path, "a")
    with hold(tmp_path, "a") as lease:
        assert lease.held
    assert vanished and "cannot open the lease file" not in caplog.text
    assert remove_if_unleased(tmp_path, "a") is True and not (tmp_path / "a").exists()


def test_two_adapters_leased_and_released_over_and_over_always_hold(tmp_path: Path) -> None:
    """Two threads take and drop leases on two adapters in one folder: each last release removes the shared lease
    folder that the other is making, and every lease still holds."""
    failures = []

    def churn(name: str) -> None:
        adapter_folder(tmp_path, name)
        for _ in range(300):
            lease = hold(tmp_path, name)
            if not lease.held:
                failures.append(name)
            lease.release()

    threads = [threading.Thread(target=churn, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert failures == [] and not any(thread.is_alive() for thread in threads)
