"""Runs ON a node (Python standard library only): the task's image found in the node's Docker
Engine, or pulled through the Engine API where it is missing, with a progress line about every
second; then what the node has (image ID and repository digests) for the laptop to compare.

    python3 dockerpull.py IMAGE ROOT [--keep]

stdin: one line, the value of the ``X-Registry-Auth`` header (base64url of the JSON
``{"username", "password", "serveraddress"}``) or an empty line. The credentials go from this
process to the Engine in that header: nothing is written to a file, an argument or the
environment. ``ROOT``: the node's cloudtrain folder; an image pulled here is recorded in
``ROOT/pulled-images`` (one reference a line) so that ``down`` can remove it again, unless
``--keep`` (the task's ``container.keep_image``), which also takes it off that list.

Lines on stdout (the laptop reads them):
    ::progress LAYERS_DONE LAYERS_TOTAL BYTES_DONE BYTES_TOTAL BYTES_PER_S
    ::image present|pulled {"id": ..., "repo_digests": [...]}   (pulled: also bytes, seconds)
    ::fail auth|pull|engine MESSAGE          (exit 3, 4, 5)
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import sys
import time
import urllib.parse

SOCKET = "/var/run/docker.sock"
API = "/v1.41"
EVERY_S = 1.0
# What the Engine says when a registry refuses (or asks for) credentials.
_AUTH_WORDS = ("unauthorized", "authentication required", "no basic auth credentials",
               "incorrect username or password", "denied", "forbidden")


class UnixConnection(http.client.HTTPConnection):
    """HTTP over the Engine's unix socket."""

    def __init__(self, path: str, timeout: float = 3600.0) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self.path)
        self.sock = s


def fail(kind: str, message: str) -> None:
    text = " ".join(message.split())[:600]
    print(f"::fail {kind} {text}", flush=True)
    sys.exit({"auth": 3, "pull": 4}.get(kind, 5))


def socket_path() -> str:
    """The Engine's socket: ``DOCKER_HOST`` when it names a unix socket (rootless Docker sets
    it, and the docker CLI on the node honours it too), else the system one."""
    host = os.environ.get("DOCKER_HOST", "")
    if not host:
        return SOCKET
    if not host.startswith("unix://"):
        fail("engine", f"DOCKER_HOST is {host[:80]} on the node: cloudtrain talks to the Docker "
                       "Engine over its unix socket only. Unset DOCKER_HOST for the SSH user, or "
                       "point it at unix:///path/to/docker.sock.")
    return host.removeprefix("unix://")


def engine(method: str, path: str, headers: dict[str, str] | None = None
           ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    where = socket_path()
    conn = UnixConnection(where)
    try:
        conn.request(method, API + path, headers=headers or {})
        return conn, conn.getresponse()
    except OSError as exc:
        fail("engine", f"cannot reach the Docker Engine at {where}: {exc}. Check that Docker "
                       "runs on the node and that the SSH user may use it (group docker).")
        raise


def inspect(image: str) -> dict[str, object] | None:
    conn, resp = engine("GET", f"/images/{urllib.parse.quote(image, safe='')}/json")
    try:
        body = resp.read()
    finally:
        conn.close()
    if resp.status == 404:
        return None
    if resp.status != 200:
        fail("engine", f"docker image inspect {image}: {_message(body)}")
    data = json.loads(body)
    return {"id": data.get("Id", ""), "repo_digests": data.get("RepoDigests") or []}


def _message(body: bytes) -> str:
    try:
        return str(json.loads(body).get("message", "")) or body.decode(errors="replace")
    except ValueError:
        return body.decode(errors="replace").strip()


def is_auth(message: str) -> bool:
    low = message.lower()
    return any(w in low for w in _AUTH_WORDS)


class Progress:
    """The pull's layers and bytes, from the Engine's JSON messages."""

    def __init__(self) -> None:
        self.layers: dict[str, tuple[int, int, bool]] = {}    # id -> (current, total, done)
        self.last = 0.0
        self.last_bytes = 0
        self.rate = 0.0

    def take(self, msg: dict[str, object]) -> None:
        lid = msg.get("id")
        status = str(msg.get("status", ""))
        if not isinstance(lid, str) or status.startswith("Pulling from"):
            return
        cur, tot, done = self.layers.get(lid, (0, 0, False))
        detail = msg.get("progressDetail")
        if status == "Downloading" and isinstance(detail, dict):
            cur = int(detail.get("current") or cur)
            tot = int(detail.get("total") or tot)
        elif status in ("Download complete", "Verifying Checksum"):
            cur = tot = max(cur, tot)
        elif status in ("Pull complete", "Already exists"):
            cur = tot = max(cur, tot)
            done = True
        self.layers[lid] = (cur, tot, done)

    def line(self, now: float) -> str:
        got = sum(c for c, _, _ in self.layers.values())
        total = sum(t for _, t, _ in self.layers.values())
        done = sum(1 for _, _, d in self.layers.values() if d)
        dt = now - self.last
        if dt > 0 and self.last:
            self.rate = max(0.0, (got - self.last_bytes) / dt)
        self.last, self.last_bytes = now, got
        return f"::progress {done} {len(self.layers)} {got} {total} {int(self.rate)}"


def pull(image: str, auth: str) -> tuple[int, float]:
    """POST /images/create, its progress shown; fails (exit) with the Engine's reason.
    Returns the bytes downloaded and the seconds it took."""
    t0 = time.monotonic()
    name, tag = split(image)
    query = urllib.parse.urlencode({"fromImage": name, "tag": tag})
    headers = {"X-Registry-Auth": auth} if auth else {}
    conn, resp = engine("POST", f"/images/create?{query}", headers)
    try:
        if resp.status != 200:
            why = _message(resp.read())
            fail("auth" if is_auth(why) else "pull", why)
        prog = Progress()
        prog.last = time.monotonic()
        print(prog.line(prog.last), flush=True)
        while True:
            raw = resp.readline()
            if not raw:
                break
            try:
                msg = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(msg, dict):
                continue
            if "error" in msg:
                why = str(msg.get("error"))
                fail("auth" if is_auth(why) else "pull", why)
            prog.take(msg)
            now = time.monotonic()
            if now - prog.last >= EVERY_S:
                print(prog.line(now), flush=True)
        print(prog.line(time.monotonic()), flush=True)
        return prog.last_bytes, time.monotonic() - t0
    finally:
        conn.close()


def split(image: str) -> tuple[str, str]:
    """The Engine's fromImage and tag (a digest goes in ``tag``, as the docker CLI sends it)."""
    if "@" in image:
        name, digest = image.split("@", 1)
        return name, digest
    last = image.rsplit("/", 1)[-1]
    if ":" in last:
        name, tag = image.rsplit(":", 1)
        return name, tag
    return image, "latest"


def record(root: str, image: str, keep: bool) -> None:
    """``ROOT/pulled-images``: the references pulled here, one a line (``--keep``: removed)."""
    path = os.path.join(root, "pulled-images")
    os.makedirs(root, exist_ok=True)
    try:
        with open(path, encoding="utf-8") as f:
            have = [ln.strip() for ln in f if ln.strip()]
    except FileNotFoundError:
        have = []
    want = [r for r in have if r != image] + ([] if keep else [image])
    if want == have:
        return
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("".join(r + "\n" for r in want))
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: dockerpull.py IMAGE ROOT [--keep]", file=sys.stderr)
        return 2
    image, root, keep = argv[0], argv[1], "--keep" in argv[2:]
    auth = sys.stdin.readline().strip()
    have = inspect(image)
    if have is not None:
        if keep:
            record(root, image, keep=True)
        print("::image present " + json.dumps(have), flush=True)
        return 0
    got, seconds = pull(image, auth)
    have = inspect(image)
    if have is None:
        fail("pull", f"the Engine reported {image} pulled, but it is not there")
        return 4
    record(root, image, keep)
    have.update(bytes=got, seconds=round(seconds, 3))
    print("::image pulled " + json.dumps(have), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
