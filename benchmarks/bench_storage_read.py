"""Which storage layer reads a checkpoint fastest: import time and streaming read throughput (issue 20's choice).

Against a real S3 API server on loopback (moto, its own process group) holding a 200 MiB object, alternating in
rounds: fsspec/s3fs's file object (``fs.open``, its default 50 MiB read-ahead blocks: ranged GETs), one streamed GET
through s3fs's own client (what ``publish`` reads), and boto3's ``get_object`` body. Import times are measured in
fresh interpreters (``import s3fs`` and ``import boto3`` plus a client), the median of five each.

    python benchmarks/bench_storage_read.py [--mb 200 --rounds 3]   # needs lora_sampler[s3] and moto[server]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

import _common

CHUNK = 1 << 20
IMPORTS = {
    "s3fs (fsspec)": "import s3fs; s3fs.S3FileSystem()",
    "boto3": "import boto3; boto3.client('s3', region_name='us-east-1')",
}


def import_seconds(statement: str, runs: int = 5) -> float:
    """Median wall time of ``statement`` in a fresh interpreter (its own clock, so start-up is not counted)."""
    code = f"import time; t = time.perf_counter(); {statement}; print(time.perf_counter() - t)"
    times = [float(subprocess.check_output([sys.executable, "-c", code], text=True)) for _ in range(runs)]
    return _common.median(times)


def drain(read: Callable[[int], bytes]) -> int:
    total = 0
    for chunk in iter(lambda: read(CHUNK), b""):
        total += len(chunk)
    return total


def readers(bucket: str, key: str) -> Dict[str, Callable[[], int]]:
    """The contenders, each reading the whole object once and returning the bytes read."""
    import boto3
    import s3fs

    from lora_sampler._adapters import storage

    url = f"s3://{bucket}/{key}"
    client = boto3.client("s3", region_name="us-east-1")

    def fsspec_file() -> int:
        with s3fs.S3FileSystem().open(url, "rb") as handle:
            return drain(handle.read)

    def streamed_get() -> int:
        return sum(len(chunk) for chunk in storage.open_object(storage.probe(url)))

    def boto3_body() -> int:
        return drain(client.get_object(Bucket=bucket, Key=key)["Body"].read)

    return {"fsspec fs.open (ranged blocks)": fsspec_file, "s3fs one streamed GET": streamed_get, "boto3": boto3_body}


def run(size: int, rounds: int) -> Dict[str, Any]:
    sys.path.insert(0, os.path.join(_common.REPO, "tests", "storage"))
    from _s3server import S3Server, boto3_client

    imports = {name: import_seconds(statement) for name, statement in IMPORTS.items()}
    samples: Dict[str, List[float]] = {}
    with S3Server() as server, tempfile.NamedTemporaryFile() as blob:
        os.environ.update(server.client_environment())
        for _ in range(0, size, CHUNK):
            blob.write(os.urandom(CHUNK))
        blob.flush()
        s3 = boto3_client(server.endpoint)
        s3.create_bucket(Bucket="ckpts")
        s3.upload_file(blob.name, "ckpts", "blob")
        contenders = readers("ckpts", "blob")
        samples = {name: [] for name in contenders}
        for round_number in range(rounds):
            names = list(contenders)
            turn = round_number % len(names)
            for name in names[turn:] + names[:turn]:
                start = time.perf_counter()
                assert contenders[name]() == size
                samples[name].append(time.perf_counter() - start)
    medians = {name: _common.median(values) for name, values in samples.items()}
    return {
        "benchmark": "storage_read",
        "stamp": _common.stamp(),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": _common.machine(),
        "object_bytes": size,
        "rounds": rounds,
        "import_median_s": imports,
        "samples_s": samples,
        "median_s": medians,
        "mib_per_s": {name: size / (1 << 20) / seconds for name, seconds in medians.items()},
    }


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--mb", type=int, default=200, help="MiB in the object (default 200)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each reader (default 3)")
    args = parser.parse_args(argv)
    result = run(args.mb << 20, args.rounds)
    print(f"{args.rounds} rounds; {_common.describe_machine(result['machine'])}")
    print(_common.table(["import", "median ms"], [[n, s * 1000] for n, s in result["import_median_s"].items()]))
    rows = [[name, result["median_s"][name] * 1000, result["mib_per_s"][name]] for name in result["median_s"]]
    print("\n" + _common.table([f"read {args.mb} MiB", "median ms", "MiB/s"], rows))
    print(f"results: {_common.write_results('bench_storage_read', result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
