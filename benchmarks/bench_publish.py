"""Publishing adapter archives versus a plain ``tarfile`` extract and ``tar x`` of them.

Three payloads, each one ``adapter_model.safetensors`` in a ``.tar.gz`` made like ``tar -czf`` (gzip level 6):
random bytes (incompressible), zeros (a fresh LoRA's ``lora_B``: a few KB of gzip expanding to hundreds of MB),
and a bf16-like tensor (random small values: a narrow exponent byte, the low mantissa bits zero). Each round runs
every case of every payload, alternating, in a rotated order:

- ``tarfile``: ``tarfile.open(path, "r:*").extractall(dest, filter="data")`` (no filter on old Pythons);
- ``tar x``: GNU ``tar -xf path -C dest`` in a subprocess;
- ``publish cold``: ``publish_checkpoint`` into a new folder: hash + extract +
  verify + fsync of every file and folder + rename;
- ``publish cold, no fsync``: the same without fsync (what the fsyncs cost);
- ``publish cached``: again into a folder already holding it (the fast path: the published folder records the
  archive's signature, so nothing is read).

Target: publish cold at most 1.5x the ``tarfile`` extract on each payload (wall time).

``--storage`` measures the storage row instead: a random-weights archive (200 MiB) on a real S3 API server
on loopback (moto, in its own process group), alternating in rounds ``publish from the URL`` (streamed once through
the extraction) with ``download, then publish`` (s3fs's ``get`` to a local file, then ``publish_checkpoint`` of it)
and ``one GET to a file, then publish`` (the same single streamed GET the URL publish reads, written to a file: the
two steps without the ranged parts, which cost moto a read of the whole object each), all cold (a new folder,
fsync on). Target: the URL at most 0.8x the two steps. The CPU time of each case
(this process's threads, plus ``tar`` and ``gzip`` for ``tar x``) is reported beside it: on a loaded machine it
moves less than wall time. Page caches stay warm (the machine is shared; nothing is dropped).

    python benchmarks/bench_publish.py [--random-mb 200 --zeros-mb 256 --bf16-mb 200 --rounds 3]
    python benchmarks/bench_publish.py --payloads zeros --zeros-mb 64 --rounds 3   # one payload
    python benchmarks/bench_publish.py --storage [--storage-mb 200 --rounds 5]   # lora_sampler[s3] and moto[server]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from functools import partial
from typing import Any, Callable, Dict, List, Optional

import _common  # puts the checkout first on sys.path

from lora_sampler import publish

ENGINE_MODEL = "bench/base-model"
#: Target from the issue: a cold publish costs at most this many plain tarfile extracts.
COLD_TARGET_RATIO = 1.5
#: "Cached ~ 0": a fast-path publish costs less than this fraction of a plain extract.
CACHED_TARGET_RATIO = 0.01
TARFILE, TAR_X, COLD, COLD_NO_FSYNC, CACHED = (
    "tarfile",
    "tar x",
    "publish cold",
    "publish cold, no fsync",
    "publish cached",
)
CASES = (TARFILE, TAR_X, COLD, COLD_NO_FSYNC, CACHED)
PAYLOADS = ("random", "zeros", "bf16")


def payload_chunks(kind: str, size: int) -> List[bytes]:
    """Return the payload as 1 MiB chunks (the last one shorter)."""
    chunks = []
    for offset in range(0, size, 1 << 20):
        length = min(1 << 20, size - offset)
        if kind == "zeros":
            chunks.append(bytes(length))
        elif kind == "random":
            chunks.append(os.urandom(length))
        else:
            chunks.append(bf16_like(length))
    return chunks


# bf16 (little-endian): low byte = 1 exponent bit + 7 mantissa bits, high byte = sign + 7 exponent bits.
_LOW_BYTE = bytes(b & 0xF0 for b in range(256))  # the low 4 mantissa bits are zero
_HIGH_BYTE = bytes((0x3C + (b & 1)) | (b & 0x80) for b in range(256))  # |values| ~ 0.004 to 0.03, either sign


def bf16_like(length: int) -> bytes:
    """Random bf16 values of LoRA-weight magnitude with the low mantissa bits zero."""
    buffer = bytearray(length)
    half = length // 2
    buffer[0 : 2 * half : 2] = os.urandom(half).translate(_LOW_BYTE)
    buffer[1 : 2 * half : 2] = os.urandom(half).translate(_HIGH_BYTE)
    return bytes(buffer)


def build_archive(folder: str, kind: str, size: int) -> str:
    """Write an adapter folder holding ``size`` bytes of ``kind`` weights and return its .tar.gz."""
    adapter = os.path.join(folder, f"{kind}-step")
    os.makedirs(adapter)
    with open(os.path.join(adapter, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "base_model_name_or_path": ENGINE_MODEL, "r": 8}, f)
    with open(os.path.join(adapter, "adapter_model.safetensors"), "wb") as f:
        for chunk in payload_chunks(kind, size):
            f.write(chunk)
    archive = os.path.join(folder, f"{kind}-step.tar.gz")
    with tarfile.open(archive, "w:gz", compresslevel=6) as tar:
        tar.add(adapter, arcname=os.path.basename(adapter))
    shutil.rmtree(adapter)
    return archive


def tarfile_extract(archive: str, dest: str) -> None:
    """Extract the way a user would without lora_sampler."""
    with tarfile.open(archive, "r:*") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:  # pragma: no cover - Python without the extraction filters
            tar.extractall(dest)


def tar_x(archive: str, dest: str) -> None:
    os.makedirs(dest)
    subprocess.run(["tar", "-xf", archive, "-C", dest], check=True)


def cpu_seconds() -> float:
    """CPU time of this process (every thread) and of its finished children (``tar x`` and its gzip)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


#: CPU seconds of the last ``timed`` call: less sensitive than wall time to the other work on a shared machine.
last_cpu = [0.0]


def timed(action: Callable[[], object]) -> float:
    """Run ``action``; return its wall seconds (its CPU seconds go to ``last_cpu``)."""
    cpu = cpu_seconds()
    start = time.perf_counter()
    action()
    wall = time.perf_counter() - start
    last_cpu[0] = cpu_seconds() - cpu
    return wall


def publish_cold(archive: str, base: str, durable: bool) -> float:
    """Time one publish into a new folder (nothing there records it: it is read, extracted and renamed)."""
    os.makedirs(base)
    publish.DEFAULT_DURABLE = durable
    try:
        return timed(partial(publish.publish_checkpoint, archive, base))
    finally:
        publish.DEFAULT_DURABLE = True


def run_case(case: str, archive: str, root: str, warm: str) -> float:
    """Run one case once into a fresh folder under ``root`` (removed afterwards) and return its seconds."""
    dest = tempfile.mkdtemp(prefix="case-", dir=root)
    os.rmdir(dest)
    try:
        if case == TARFILE:
            return timed(partial(tarfile_extract, archive, dest))
        if case == TAR_X:
            return timed(partial(tar_x, archive, dest))
        if case in (COLD, COLD_NO_FSYNC):
            return publish_cold(archive, dest, durable=case == COLD)
        publish.checkpoint_digest(archive)  # the cold cases cleared the cache
        return timed(partial(publish.publish_checkpoint, archive, warm))
    finally:
        shutil.rmtree(dest, ignore_errors=True)


def medians_of(samples: Dict[str, Dict[str, List[float]]]) -> Dict[str, Dict[str, float]]:
    return {kind: {case: _common.median(values) for case, values in cases.items()} for kind, cases in samples.items()}


def result_header(name: str, load: List[float]) -> Dict[str, Any]:
    """The fields every results file of this script starts with: what ran, when, where, and the machine's load."""
    return {
        "benchmark": name,
        "stamp": _common.stamp(),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": _common.machine(),
        "load_average_1min": load,
    }


def run(sizes: Dict[str, int], rounds: int, workdir: Optional[str]) -> Dict[str, Any]:
    """Run the rounds, alternating payloads and cases, and return every sample, the medians and the ratios."""
    root = tempfile.mkdtemp(prefix="bench-publish-", dir=workdir)
    samples: Dict[str, Dict[str, List[float]]] = {kind: {case: [] for case in CASES} for kind in sizes}
    cpu: Dict[str, Dict[str, List[float]]] = {kind: {case: [] for case in CASES} for kind in sizes}
    archive_bytes: Dict[str, int] = {}
    load: List[float] = []
    try:
        archives = {kind: build_archive(root, kind, size) for kind, size in sizes.items()}
        warm = os.path.join(root, "warm")
        os.makedirs(warm)
        for kind, archive in archives.items():
            archive_bytes[kind] = os.path.getsize(archive)
            publish.publish_checkpoint(archive, warm)  # the fast-path target; also warms the page cache
        for round_number in range(rounds):
            load.append(os.getloadavg()[0])
            for kind, archive in archives.items():
                order = CASES[round_number % len(CASES) :] + CASES[: round_number % len(CASES)]
                for case in order:
                    samples[kind][case].append(run_case(case, archive, root, warm))
                    cpu[kind][case].append(last_cpu[0])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    medians = {
        kind: {case: _common.median(values) for case, values in cases.items()} for kind, cases in samples.items()
    }
    ratios = {kind: {case: value / m[TARFILE] for case, value in m.items()} for kind, m in medians.items()}
    cpu_medians = {
        kind: {case: _common.median(values) for case, values in cases.items()} for kind, cases in cpu.items()
    }
    return {
        **result_header("publish", load),
        "payload_bytes": sizes,
        "archive_bytes": archive_bytes,
        "rounds": rounds,
        "samples_s": samples,
        "median_s": medians,
        "ratio_to_tarfile": ratios,
        "cpu_samples_s": cpu,
        "cpu_median_s": cpu_medians,
        "targets": {
            kind: {
                f"cold <= {COLD_TARGET_RATIO}x tarfile": r[COLD] <= COLD_TARGET_RATIO,
                f"cached < {CACHED_TARGET_RATIO}x tarfile": r[CACHED] < CACHED_TARGET_RATIO,
            }
            for kind, r in ratios.items()
        },
    }


#: Target from issue 20: publishing from the URL costs at most this many "download, then publish" runs.
STORAGE_TARGET_RATIO = 0.8
FROM_URL, DOWNLOAD_THEN_PUBLISH, ONE_GET_THEN_PUBLISH = (
    "publish from the URL",
    "download, then publish",
    "one GET to a file, then publish",
)
STORAGE_CASES = (FROM_URL, DOWNLOAD_THEN_PUBLISH, ONE_GET_THEN_PUBLISH)


def download_in_one_get(url: str, local: str) -> None:
    """Copy the object to ``local`` over the same single streamed GET the URL publish reads (no ranged parts)."""
    from lora_sampler._adapters import storage

    with open(local, "wb") as out:
        out.writelines(storage.open_object(storage.probe(url)))


def storage_case(case: str, url: str, root: str) -> float:
    """Run one storage case cold into a fresh folder under ``root`` (removed afterwards); return its seconds."""
    import s3fs

    base = tempfile.mkdtemp(prefix="storage-", dir=root)
    local = os.path.join(root, "downloaded.tar.gz")

    def two_steps() -> None:
        if case == DOWNLOAD_THEN_PUBLISH:
            s3fs.S3FileSystem().get(url, local)  # the storage library's own download (ranged parts)
        else:
            download_in_one_get(url, local)
        publish.publish_checkpoint(local, base)

    try:
        return timed(partial(publish.publish_checkpoint, url, base) if case == FROM_URL else two_steps)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(local)


def run_storage(size: int, rounds: int, workdir: Optional[str]) -> Dict[str, Any]:
    """Time the storage cases against a loopback S3 server, alternating (rotated order) in each round."""
    sys.path.insert(0, os.path.join(_common.REPO, "tests", "storage"))
    from _s3server import S3Server, boto3_client

    root = tempfile.mkdtemp(prefix="bench-storage-", dir=workdir)
    samples: Dict[str, List[float]] = {case: [] for case in STORAGE_CASES}
    cpu: Dict[str, List[float]] = {case: [] for case in STORAGE_CASES}
    load: List[float] = []
    try:
        with S3Server() as server:
            os.environ.update(server.client_environment())
            archive = build_archive(root, "random", size)
            archive_bytes = os.path.getsize(archive)
            s3 = boto3_client(server.endpoint)
            s3.create_bucket(Bucket="ckpts")
            s3.upload_file(archive, "ckpts", "run1/step-400.tar.gz")
            os.unlink(archive)
            url = "s3://ckpts/run1/step-400.tar.gz"
            storage_case(FROM_URL, url, root)  # warm-up: connections, imports, the server's first reads
            for round_number in range(rounds):
                load.append(os.getloadavg()[0])
                turn = round_number % len(STORAGE_CASES)
                order = STORAGE_CASES[turn:] + STORAGE_CASES[:turn]
                for case in order:
                    samples[case].append(storage_case(case, url, root))
                    cpu[case].append(last_cpu[0])
            requests_served = server.counts()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    medians = {case: _common.median(values) for case, values in samples.items()}
    ratio = medians[FROM_URL] / medians[DOWNLOAD_THEN_PUBLISH]
    ratio_one_get = medians[FROM_URL] / medians[ONE_GET_THEN_PUBLISH]
    return {
        **result_header("publish_storage", load),
        "payload_bytes": size,
        "archive_bytes": archive_bytes,
        "rounds": rounds,
        "server_requests": requests_served,
        "samples_s": samples,
        "median_s": medians,
        "cpu_samples_s": cpu,
        "cpu_median_s": {case: _common.median(values) for case, values in cpu.items()},
        "ratio_url_to_two_steps": ratio,
        "ratio_url_to_one_get_then_publish": ratio_one_get,
        "targets": {
            "not slower than download, then publish": ratio <= 1.0,
            f"url <= {STORAGE_TARGET_RATIO}x download, then publish": ratio <= STORAGE_TARGET_RATIO,
            "not slower than one GET to a file, then publish": ratio_one_get <= 1.0,
            f"url <= {STORAGE_TARGET_RATIO}x one GET to a file, then publish": ratio_one_get <= STORAGE_TARGET_RATIO,
        },
    }


def main_storage(size_mb: int, rounds: int, workdir: Optional[str], json_path: Optional[str]) -> int:
    result = run_storage(size_mb << 20, rounds, workdir)
    print(f"{rounds} rounds; {_common.describe_machine(result['machine'])}; load {result['load_average_1min']}")
    print(f"\nstorage: {size_mb} MiB of random weights in a {result['archive_bytes']:,}-byte .tar.gz on loopback S3")
    medians, cpu, two_steps = result["median_s"], result["cpu_median_s"], result["median_s"][DOWNLOAD_THEN_PUBLISH]
    rows = [[case, medians[case] * 1000, medians[case] / two_steps, cpu[case] * 1000] for case in STORAGE_CASES]
    print(_common.table(["case", "median ms", "x two steps", "CPU ms"], rows))
    for target, ok in result["targets"].items():
        print(f"{_common.verdict(ok)}  {target}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"results: {json_path}")
    else:
        print(f"results: {_common.write_results('bench_publish_storage', result)}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--payloads", default=",".join(PAYLOADS), help="comma-separated: random,zeros,bf16")
    parser.add_argument("--random-mb", type=int, default=200, help="MiB of random weights (default 200)")
    parser.add_argument("--zeros-mb", type=int, default=256, help="MiB of zero weights (default 256)")
    parser.add_argument("--bf16-mb", type=int, default=200, help="MiB of bf16-like weights (default 200)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each case (default 3)")
    parser.add_argument("--json", help="write the results here (default: benchmarks/results/bench_publish.json)")
    parser.add_argument("--workdir", help="folder for the archives and targets (default: the system temp folder)")
    parser.add_argument("--storage", action="store_true", help="the storage row: publish from a loopback S3 URL")
    parser.add_argument("--storage-mb", type=int, default=200, help="MiB of random weights on S3 (default 200)")
    args = parser.parse_args(argv)
    if args.storage:
        return main_storage(args.storage_mb, args.rounds, args.workdir, args.json)
    megabytes = {"random": args.random_mb, "zeros": args.zeros_mb, "bf16": args.bf16_mb}
    kinds = [kind.strip() for kind in args.payloads.split(",") if kind.strip()]
    unknown = [kind for kind in kinds if kind not in PAYLOADS]
    if unknown:
        parser.error(f"unknown payloads {unknown}; choose from {', '.join(PAYLOADS)}")
    result = run({kind: megabytes[kind] << 20 for kind in kinds}, args.rounds, args.workdir)
    print(f"{args.rounds} rounds; {_common.describe_machine(result['machine'])}; load {result['load_average_1min']}")
    for kind in kinds:
        medians, ratios, cpu = result["median_s"][kind], result["ratio_to_tarfile"][kind], result["cpu_median_s"][kind]
        print(f"\n{kind}: {megabytes[kind]} MiB in a {result['archive_bytes'][kind]:,}-byte .tar.gz")
        rows = [[c, medians[c] * 1000, ratios[c], cpu[c] * 1000, cpu[c] / cpu[TARFILE]] for c in CASES]
        print(_common.table(["case", "median ms", "x tarfile", "CPU ms", "CPU x tarfile"], rows))
        for target, ok in result["targets"][kind].items():
            print(f"{_common.verdict(ok)}  {target}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"results: {args.json}")
    else:
        print(f"results: {_common.write_results('bench_publish', result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
