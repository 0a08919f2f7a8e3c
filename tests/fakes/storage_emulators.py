"""Object-storage emulators on loopback for the storage tests: moto's S3 server, Azurite (Azure
Blob) and gcp-storage-emulator (GCS), each started as its own process on a free port, with
its request log kept in a file (the tests read it to see which requests the NODES made).

Each emulator gives: ``url(prefix)`` (the bucket URL a task names), ``envs`` (what the task's
``envs`` must carry so the nodes reach it: the "local provider" case), ``put``/``keys``/
``delete`` for the test itself (through rclone with cloudtrain's own remote builder, the same
path the nodes use), and ``requests(text)`` (log lines mentioning ``text``)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
from cloudtrain.node import store

# Azurite's documented development account and key (public, for the emulator only).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/"
               "K1SZFPTOtr/KBHBeksoGMGw==")
BUCKET = "ct-bucket"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def azurite_bin() -> str | None:
    for cand in (os.environ.get("CLOUDTRAIN_AZURITE"),
                 str(REPO / "tests" / ".npm" / "node_modules" / ".bin" / "azurite-blob"),
                 shutil.which("azurite-blob")):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def gcs_bin() -> str | None:
    for cand in (str(Path(sys.executable).parent / "gcp-storage-emulator"),
                 os.environ.get("CLOUDTRAIN_GCS_EMULATOR"), shutil.which("gcp-storage-emulator")):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


@dataclass
class Emulator:
    kind: str                      # s3 | gs | az
    port: int
    log: Path
    proc: subprocess.Popen[bytes]
    envs: dict[str, str] = field(default_factory=dict)

    def url(self, prefix: str) -> str:
        if self.kind == "s3":
            return f"s3://{BUCKET}/{prefix}"
        if self.kind == "gs":
            return f"gs://{BUCKET}/{prefix}"
        return f"http://127.0.0.1:{self.port}/{AZURITE_ACCOUNT}/{BUCKET}/{prefix}"

    def _rclone(self, *args: str, stdin: bytes | None = None) -> bytes:
        url = store.parse_url(self.url("x"))
        base = {**os.environ, **self.envs}
        env = store.rclone_env(url, base)
        p = subprocess.run(["rclone", "--retries", "1", "--low-level-retries", "1", *args],
                           env=env, input=stdin, capture_output=True, timeout=60)
        if p.returncode != 0:
            raise RuntimeError(f"rclone {args}: {p.stderr.decode()[-500:]}")
        return p.stdout

    def remote(self, key: str) -> str:
        return f"{store.REMOTE}:{BUCKET}/{key}"

    def put(self, key: str, data: bytes) -> None:
        self._rclone("rcat", self.remote(key), stdin=data)

    def keys(self, prefix: str) -> dict[str, int]:
        try:
            out = self._rclone("lsjson", "-R", "--files-only", self.remote(prefix))
        except RuntimeError:
            return {}
        return {i["Path"]: i["Size"] for i in json.loads(out or b"[]")}

    def cat(self, key: str) -> bytes:
        return self._rclone("cat", self.remote(key))

    def delete(self, key: str) -> None:
        self._rclone("deletefile", self.remote(key))

    def requests(self, text: str) -> list[str]:
        return [ln for ln in self.log.read_text(errors="replace").splitlines() if text in ln]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _wait_port(port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"emulator exited: {log.read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"emulator did not listen on {port}: {log.read_text()[-2000:]}")


def start(kind: str, workdir: Path) -> Emulator:
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = workdir / f"{kind}-emulator.log"
    out = open(log, "wb")
    if kind == "s3":
        cmd = [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)]
        envs = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    elif kind == "gs":
        binary = gcs_bin()
        if binary is None:
            raise FileNotFoundError("gcp-storage-emulator (pip install -e '.[dev]')")
        cmd = [binary, "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory"]
        envs = {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}"}
    else:
        binary = azurite_bin()
        if binary is None:
            raise FileNotFoundError("azurite-blob (scripts/setup.sh installs it into tests/.npm)")
        cmd = [binary, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
               "--skipApiVersionCheck", "--loose"]
        envs = {"AZURE_STORAGE_KEY": AZURITE_KEY}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "AZURE_"))}
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    emu = Emulator(kind, port, log, proc, envs)
    try:
        _wait_port(port, proc, log)
        _make_bucket(emu)
    except Exception:
        emu.stop()
        raise
    return emu


def _make_bucket(emu: Emulator) -> None:
    if emu.kind == "gs":
        # rclone cannot create a GCS bucket without a project number; the JSON API can.
        req = urllib.request.Request(f"http://127.0.0.1:{emu.port}/storage/v1/b?project=test",
                                     data=json.dumps({"name": BUCKET}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:  # noqa: S310 (loopback)
            r.read()
    else:
        emu._rclone("mkdir", f"{store.REMOTE}:{BUCKET}")
