#!/usr/bin/env python3
"""Bucket transfers the way the nodes make them: rclone against moto's S3 server on loopback.

1. ``--files`` x ``--file-mb`` MB of random bytes (default 16 x 8 MB = 128 MB);
2. rclone copy up and down with ``--transfers 1`` and ``--transfers 8`` (MB/s, median of
   ``--repeats``), the remote built by cloudtrain/node/store.py from environment variables;
3. the checkpoint protocol itself: ``store.py upload`` (sha256 of every file, content-addressed
   objects, manifest last) and ``store.py restore`` (download + sha256 check) of the same tree,
   and a repeat upload with nothing changed (objects already there: only the manifest goes);
4. the same files with boto3 (the SDK alternative for S3 only), one at a time and 8 threads;
5. install cost: the rclone binary's size, and boto3 + botocore + s3transfer on disk.

moto keeps every object in one Python process: absolute MB/s are moto's, the ratios (1 vs 8
transfers, rclone vs boto3) are what carries over.

    python bench/bench_storage.py [--files 16] [--file-mb 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "fakes"))
import storage_emulators as emus  # noqa: E402 - imported after the sys.path set-up above

from cloudtrain.node import store  # noqa: E402 - imported after the sys.path set-up above

STORE = REPO / "cloudtrain" / "node" / "store.py"


def du(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def boto3_rates(emu: Any, files: list[Path], tmp: Path, repeats: int,
                total_mb: float) -> list[tuple[str, float, float]]:
    """boto3's own upload_file/download_file over the same files: MB/s up and down."""
    import boto3

    out = []
    s3 = boto3.client("s3", endpoint_url=emu.envs["AWS_ENDPOINT_URL"], region_name="us-east-1",
                      aws_access_key_id="testing", aws_secret_access_key="testing", verify=False)
    for n in (1, 8):
        ups, downs = [], []
        for r in range(repeats):
            t0 = time.monotonic()
            key = f"b3/{n}-{r}"
            with ThreadPoolExecutor(n) as pool:
                list(pool.map(lambda p, key=key: s3.upload_file(str(p), emus.BUCKET,
                                                                  f"{key}/{p.name}"), files))
            ups.append(time.monotonic() - t0)
            d = tmp / f"b3-{n}-{r}"
            d.mkdir()
            t0 = time.monotonic()
            with ThreadPoolExecutor(n) as pool:
                list(pool.map(lambda p, key=key, d=d: s3.download_file(
                    emus.BUCKET, f"{key}/{p.name}", str(d / p.name)), files))
            downs.append(time.monotonic() - t0)
            shutil.rmtree(d)
        out.append((f"boto3 upload_file/download_file, {n} thread(s)",
                    total_mb / statistics.median(ups), total_mb / statistics.median(downs)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=16)
    ap.add_argument("--file-mb", type=float, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-storage-"))
    emu = emus.start("s3", tmp / "emu")
    try:
        src = tmp / "src"
        src.mkdir()
        size = int(a.file_mb * 1024 * 1024)
        for i in range(a.files):
            (src / f"shard-{i:04d}.bin").write_bytes(os.urandom(size))
        total_mb = a.files * size / 1e6
        base = {**os.environ, **emu.envs}
        env = store.rclone_env(store.parse_url(emu.url("bench")), base)
        rows = []

        def rclone(*args: str) -> float:
            t0 = time.monotonic()
            subprocess.run(["rclone", "--stats", "0", *args], env=env, check=True,
                           capture_output=True)
            return time.monotonic() - t0

        for n in (1, 8):
            ups, downs = [], []
            for r in range(a.repeats):
                dst = f"cts:{emus.BUCKET}/bench/t{n}-{r}"
                ups.append(rclone("copy", "--transfers", str(n), str(src), dst))
                down = tmp / f"down-{n}-{r}"
                downs.append(rclone("copy", "--transfers", str(n), dst, str(down)))
                shutil.rmtree(down)
            rows.append((f"rclone copy --transfers {n}", total_mb / statistics.median(ups),
                         total_mb / statistics.median(downs)))

        def store_py(*args: str) -> float:
            t0 = time.monotonic()
            subprocess.run([sys.executable, str(STORE), *args],
                           env={**base, "CLOUDTRAIN_STORE_TRANSFERS": "8"},
                           check=True, capture_output=True)
            return time.monotonic() - t0

        ups, downs, again = [], [], []
        for r in range(a.repeats):
            url = emu.url(f"bench/ckpt-{r}")
            ups.append(store_py("upload", url, str(src)))
            again.append(store_py("upload", url, str(src)))
            d = tmp / f"restore-{r}"
            downs.append(store_py("restore", url, str(d)))
            shutil.rmtree(d)
        rows.append(("store.py upload / restore (sha256, manifest)", total_mb / statistics.median(ups),
                     total_mb / statistics.median(downs)))

        rows += boto3_rates(emu, sorted(src.iterdir()), tmp, a.repeats, total_mb)

        print(f"{a.files} files x {a.file_mb:g} MB = {total_mb:.0f} MB, moto S3 server on loopback, "
              f"median of {a.repeats}")
        print("| transfer | up MB/s | down MB/s |\n|---|---|---|")
        for name, up, down in rows:
            print(f"| {name} | {up:.0f} | {down:.0f} |")
        print(f"| store.py upload, nothing changed (manifest only) | {statistics.median(again):.2f} s | |")
        rc = Path(shutil.which("rclone") or "/usr/bin/rclone").resolve()
        ver = subprocess.run(["rclone", "version"], capture_output=True, text=True).stdout.split("\n")[0]
        import boto3 as b3mod
        import botocore
        import s3transfer
        sdk = sum(du(Path(m.__file__).parent) for m in (b3mod, botocore, s3transfer))
        print(f"\ninstall: {ver}: {du(rc) / 1e6:.0f} MB, one static binary for S3, GCS and Azure Blob; "
              f"boto3+botocore+s3transfer (S3 only): {sdk / 1e6:.0f} MB of Python")
    finally:
        emu.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
