"""cloudtrain's storage agent on a node: bucket file_mounts and checkpoints, through rclone.
Runs with the node's own python3 (stdlib only), installed by bootstrap next to ctjob.sh:

    python3 store.py fetch URL DEST      copy URL's objects into DEST (skipped when unchanged)
    python3 store.py restore URL DIR     newest COMPLETE checkpoint of URL into DIR
    python3 store.py upload URL DIR      one snapshot of DIR into URL (objects, then manifest)
    python3 store.py watch URL DIR [--pid PID]   upload after each settled change of DIR until
                                         PID ends (SIGTERM only asks for a last pass)

Credentials never appear on a command line or in a file: rclone's remote ``cts`` comes from
``RCLONE_CONFIG_CTS_*`` variables (the URL; the task's ``envs`` or the node's cloud identity).
Layout under URL (docs/storage.md): ``objects/<sha256>`` (file contents, uploaded once) and
``manifests/<time>-<node>-<step>.json`` (one per snapshot, written LAST). A checkpoint exists
only when its manifest does; restore uses the newest manifest whose objects are all present
with their sizes and sha256. Exit codes: 0 done; 3 nothing to restore; 2 bad arguments; 4
rclone missing; 1 other failure.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
from typing import Any

REMOTE = "cts"
NOTHING, USAGE, NO_RCLONE, FAILED = 3, 2, 4, 1
HEX64 = re.compile(r"^[0-9a-f]{64}$")
STEP = re.compile(r"step-0*(\d+)")
MAX_MANIFEST = 16 << 20   # bytes read of one manifest (the bucket's content is untrusted)
PARTIAL = (".tmp", ".part", ".partial", ".incomplete")


class StoreError(Exception):
    def __init__(self, message: str, code: int = FAILED) -> None:
        super().__init__(message)
        self.code = code


class StopInterrupted(StoreError):
    """rclone ended by the job's stop (SIGTERM): the watcher's last pass sends it again."""


# --- URL -> rclone remote (environment only) ------------------------------------------------

def parse_url(text: str) -> dict[str, str]:
    """s3://B/P, gs://B/P, https://ACCOUNT.blob.core.windows.net/C/P, http://127.0.0.1:PORT/ACCOUNT/C/P.
    The laptop checked the URL fully (cloudtrain.storage.url); this re-checks the shape."""
    u = urllib.parse.urlsplit(text)
    path = [s for s in u.path.split("/") if s]
    if any(s in (".", "..") for s in path) or u.query or u.fragment:
        raise StoreError(f"bad bucket URL '{text}'", USAGE)
    if u.scheme in ("s3", "gs") and u.netloc:
        return {"scheme": u.scheme, "bucket": u.netloc, "prefix": "/".join(path)}
    if u.scheme == "https" and u.netloc.endswith(".blob.core.windows.net") and path:
        return {"scheme": "az", "account": u.netloc.split(".")[0], "bucket": path[0],
                "prefix": "/".join(path[1:]), "endpoint": ""}
    if u.scheme == "http" and u.hostname in ("127.0.0.1", "localhost", "::1") and len(path) >= 2:
        return {"scheme": "az", "account": path[0], "bucket": path[1], "prefix": "/".join(path[2:]),
                "endpoint": f"http://{u.netloc}"}
    raise StoreError(f"bad bucket URL '{text}'", USAGE)


def _azure_key(env: dict[str, str]) -> str:
    if env.get("AZURE_STORAGE_KEY"):
        return env["AZURE_STORAGE_KEY"]
    conn = env.get("AZURE_STORAGE_CONNECTION_STRING", "")
    for part in conn.split(";"):
        k, _, v = part.partition("=")
        if k.strip() == "AccountKey":
            return v.strip()
    return ""


def account_sas(account: str, key: str, endpoint: str, hours: float = 24.0) -> str:
    """An account SAS URL (blob service, container + object) signed with the account key: how
    rclone 1.60 reaches an emulator at a URL of our choosing (its 'endpoint' is a domain suffix,
    and 'use_emulator' is tied to port 10000)."""
    expiry = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + hours * 3600))
    f = {"sv": "2018-11-09", "ss": "b", "srt": "sco", "sp": "rwdlac", "se": expiry,
         "spr": "https,http"}
    to_sign = "\n".join([account, f["sp"], f["ss"], f["srt"], "", expiry, "", f["spr"], f["sv"], ""])
    f["sig"] = base64.b64encode(hmac.new(base64.b64decode(key), to_sign.encode(),
                                         hashlib.sha256).digest()).decode()
    return f"{endpoint}/{account}?" + urllib.parse.urlencode(f)


def _term_blocked() -> None:
    """rclone starts with SIGTERM blocked (its Go runtime may unblock it: StopInterrupted)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


def rclone_env(url: dict[str, str], base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment rclone runs with: the job's, plus remote ``cts`` for this URL."""
    env = dict(os.environ if base is None else base)
    # rclone 1.60's S3 backend fails with LoadCustomCABundleError when AWS_CA_BUNDLE is set.
    env.pop("AWS_CA_BUNDLE", None)
    for k in [k for k in env if k.startswith("RCLONE_CONFIG_CTS_")]:
        del env[k]
    env["RCLONE_CONFIG"] = ""          # no config file: the remote is the variables below
    p = "RCLONE_CONFIG_CTS_"
    if url["scheme"] == "s3":
        env[p + "TYPE"] = "s3"
        env[p + "ENV_AUTH"] = "true"   # AWS_ACCESS_KEY_ID/SECRET from the job env, else the instance profile
        endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or ""
        env[p + "PROVIDER"] = "Other" if endpoint else "AWS"
        if endpoint:
            env[p + "ENDPOINT"] = endpoint
        region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or ""
        if region:
            env[p + "REGION"] = region
    elif url["scheme"] == "gs":
        env[p + "TYPE"] = "google cloud storage"
        emu = env.get("STORAGE_EMULATOR_HOST", "")
        if emu:
            env[p + "ENDPOINT"] = emu if "://" in emu else f"http://{emu}"
            env[p + "ANONYMOUS"] = "true"
        else:
            env[p + "ENV_AUTH"] = "true"   # the metadata server, or GOOGLE_APPLICATION_CREDENTIALS
        env[p + "BUCKET_POLICY_ONLY"] = "true"
    else:
        env[p + "TYPE"] = "azureblob"
        key = _azure_key(env)
        if url["endpoint"]:
            if not key:
                raise StoreError("the Azure emulator URL needs AZURE_STORAGE_KEY (or "
                                 "AZURE_STORAGE_CONNECTION_STRING) in the task's envs", USAGE)
            env[p + "SAS_URL"] = account_sas(url["account"], key, url["endpoint"])
        else:
            env[p + "ACCOUNT"] = url["account"]
            if key:
                env[p + "KEY"] = key
            else:
                env[p + "USE_MSI"] = "true"   # the node's managed identity
    return env


def remote_path(url: dict[str, str], *parts: str) -> str:
    segs = [url["bucket"]] + [s for s in url["prefix"].split("/") if s]
    segs += [s for p in parts for s in p.split("/") if s]
    return f"{REMOTE}:" + "/".join(segs)


class Rclone:
    def __init__(self, url_text: str, transfers: int | None = None) -> None:
        self.url_text = url_text.rstrip("/")
        self.url = parse_url(url_text)
        self.env = rclone_env(self.url)
        self.transfers = transfers or int(os.environ.get("CLOUDTRAIN_STORE_TRANSFERS", "8"))
        if shutil.which("rclone", path=self.env.get("PATH")) is None:
            raise StoreError("rclone is not installed on this node; install it "
                             "(sudo apt-get install rclone) and launch again", NO_RCLONE)

    def _call(self, args: list[str], stdin: bytes | None, check: bool) -> subprocess.CompletedProcess:
        cmd = ["rclone", "--retries", "3", "--low-level-retries", "3", *args]
        p = subprocess.run(cmd, env=self.env, input=stdin, capture_output=True, preexec_fn=_term_blocked)
        if check and p.returncode == -signal.SIGTERM:      # a list, copy or delete alike
            raise StopInterrupted(f"rclone {args[0]} was stopped with the job")
        return p

    def run(self, *args: str, stdin: bytes | None = None, check: bool = True) -> bytes:
        p = self._call([args[0], "--stats", "0", *args[1:]], stdin, check)
        if check and p.returncode != 0:
            err = [ln for ln in p.stderr.decode(errors="replace").splitlines() if ln.strip()]
            raise StoreError(f"rclone {args[0]} failed: " + (err or [f"exit {p.returncode}"])[-1][:400])
        return p.stdout

    def lsjson(self, *parts: str, hashes: bool = False) -> list[dict]:
        flag = ["--hash"] if hashes else []
        p = self._call(["lsjson", *flag, "--files-only", "-R", remote_path(self.url, *parts)], None, True)
        if p.returncode == 3:      # rclone: directory not found (nothing under this prefix yet)
            return []
        if p.returncode != 0:      # e.g. no access: never mistaken for "no checkpoint yet"
            err = [ln for ln in p.stderr.decode(errors="replace").splitlines() if ln.strip()]
            raise StoreError(f"cannot list {self.url_text}: " + (err or [f"exit {p.returncode}"])[-1][:400])
        try:
            items = json.loads(p.stdout or b"[]")
        except ValueError:
            raise StoreError(f"cannot list {self.url_text}: rclone gave no JSON") from None
        return [i for i in items if isinstance(i, dict) and not i.get("IsDir")]


def _say(msg: str) -> None:
    print(f"[store] {msg}", flush=True)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# --- fetch (bucket file_mounts) -------------------------------------------------------------

def fetch(url_text: str, dest: str) -> int:
    rc = Rclone(url_text)
    os.makedirs(dest, exist_ok=True)
    listing = rc.lsjson(hashes=True)
    if not listing:
        raise StoreError(f"{url_text} holds no objects (or cannot be listed with the node's credentials)")
    bad = [i["Path"] for i in listing if safe_rel(i.get("Path")) is None]
    if bad:
        # An object key such as 'a/../../x' would name a file outside DEST: refuse them all.
        raise StoreError(f"{url_text} has object names that would leave {dest}: {bad[0][:80]!r}")
    digest = hashlib.sha256(json.dumps(sorted((i["Path"], i["Size"], i.get("Hashes", {}).get("md5", ""),
                                               i.get("ModTime", "")) for i in listing)).encode()).hexdigest()
    stamp = os.path.join(dest, ".cloudtrain-fetched")
    try:
        with open(stamp) as f:
            before = f.read().strip()
    except OSError:
        before = ""
    total = sum(int(i["Size"]) for i in listing)
    # rclone's own compare (size + modtime/hash) skips files already there; the listing hash
    # lets a repeat launch say so without a second look.
    rc.run("copy", "--transfers", str(rc.transfers), "--exclude", ".cloudtrain-fetched",
           remote_path(rc.url), dest)
    with open(stamp + ".tmp", "w") as f:
        f.write(digest + "\n")
    os.replace(stamp + ".tmp", stamp)
    word = "unchanged" if before == digest else "fetched"
    _say(f"{word} {url_text} -> {dest} ({len(listing)} files, {_size(total)})")
    return 0


# --- snapshots (upload / watch) -------------------------------------------------------------

def scan(directory: str) -> dict[str, tuple[int, int]]:
    """Regular files under DIR (relative path -> (size, mtime_ns)), without partial files,
    hidden files and symlinks."""
    out: dict[str, tuple[int, int]] = {}
    for root, dirs, files in os.walk(directory, followlinks=False):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            if name.startswith(".") or name.endswith(PARTIAL):
                continue
            full = os.path.join(root, name)
            try:
                st = os.lstat(full)
            except OSError:
                continue
            if not os.path.isfile(full) or os.path.islink(full):
                continue
            out[os.path.relpath(full, directory).replace(os.sep, "/")] = (st.st_size, st.st_mtime_ns)
    return out


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def step_of(directory: str, names: list[str]) -> int | None:
    try:
        with open(os.path.join(directory, "latest")) as f:
            m = STEP.search(f.read(200))
        if m:
            return int(m.group(1))
    except OSError:
        pass
    steps = [int(m.group(1)) for n in names if (m := STEP.search(os.path.basename(n)))]
    return max(steps) if steps else None


def upload(url_text: str, directory: str, rc: Rclone | None = None, quiet_empty: bool = False) -> int:
    rc = rc or Rclone(url_text)
    files = scan(directory)
    if not files:
        if not quiet_empty:
            _say(f"nothing to upload in {directory}")
        return 0
    t0 = time.monotonic()
    # Hard links pin each file's content (a trainer replaces files by rename) while it is
    # hashed and uploaded, so the manifest's sha256 is what was sent.
    stage = tempfile.mkdtemp(prefix=".cts-up-", dir=os.path.dirname(os.path.abspath(directory)))
    try:
        entries: list[dict[str, Any]] = []
        for rel in sorted(files):
            src = os.path.join(directory, rel)
            tmp = os.path.join(stage, f"f{len(entries)}")
            try:
                os.link(src, tmp)
            except OSError:
                try:
                    shutil.copy2(src, tmp)
                except OSError:
                    continue   # vanished meanwhile (pruned by the trainer)
            digest = sha256_file(tmp)
            entries.append({"path": rel, "size": os.path.getsize(tmp), "sha256": digest, "tmp": tmp})
        have = {i["Path"]: int(i["Size"]) for i in rc.lsjson("objects")}
        todo: dict[str, int] = {}
        for e in entries:
            if have.get(e["sha256"]) != e["size"]:
                dst = os.path.join(stage, "up", e["sha256"])
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                if not os.path.exists(dst):
                    os.link(e["tmp"], dst)
                todo[e["sha256"]] = e["size"]
        if todo:
            rc.run("copy", "--transfers", str(rc.transfers), os.path.join(stage, "up"),
                   remote_path(rc.url, "objects"))
        step = step_of(directory, [e["path"] for e in entries])
        now = time.time()
        node = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:40] or "node"
        name = (time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f"{int(now * 1e6) % 1000000:06d}Z"
                + f"-{node}" + (f"-step-{step:06d}" if step is not None else "") + ".json")
        manifest = {"version": 1, "time": now, "node": node, "step": step,
                    "files": [{k: e[k] for k in ("path", "size", "sha256")} for e in entries]}
        # The manifest LAST: only now is this checkpoint complete.
        rc.run("rcat", remote_path(rc.url, "manifests", name),
               stdin=json.dumps(manifest, indent=1).encode())
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    label = f"step-{step:06d}" if step is not None else name
    _say(f"Uploaded checkpoint {label} to {url_text} ({len(entries)} files, "
         f"{_size(sum(todo.values()))} new, {time.monotonic() - t0:.1f}s)")
    return 0


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as exc:      # PermissionError: it runs, as another user
        return not isinstance(exc, ProcessLookupError)
    return True


def watch(url_text: str, directory: str, pid: int | None, interval: float) -> int:
    rc = Rclone(url_text)
    stopping = {"term": False}
    signal.signal(signal.SIGTERM, lambda *_: stopping.update(term=True))
    last_sent: dict[str, tuple[int, int]] = {}
    prev: dict[str, tuple[int, int]] | None = None
    failures = 0

    while (not stopping["term"]) if pid is None else _running(pid):
        time.sleep(interval)
        cur = scan(directory)
        # A snapshot is taken when the directory has settled (two scans alike) and differs
        # from the last one sent.
        if cur and cur == prev and cur != last_sent:
            try:
                upload(url_text, directory, rc)
                last_sent = cur
            except StopInterrupted:     # the job is being stopped: the last pass sends it
                _say("upload interrupted by the job's stop; the last pass sends it again")
            except StoreError as exc:   # the last pass below sends this state again
                failures += 1
                _say(f"upload failed ({exc}); retrying at the next change")
        prev = cur
    cur = scan(directory)
    if cur and cur != last_sent:
        upload(url_text, directory, rc)   # the last pass: what the job wrote when it ended
    if failures:
        _say(f"{failures} upload(s) failed while the job ran")
    return 0


# --- restore --------------------------------------------------------------------------------

def safe_rel(path: object) -> str | None:
    """A manifest's file path, if it stays inside the directory: relative, no '..', no empty
    or hidden-control segments."""
    if not isinstance(path, str) or not path or path.startswith("/") or "\\" in path:
        return None
    segs = path.split("/")
    if any(s in ("", ".", "..") or any(ord(c) < 32 for c in s) for s in segs):
        return None
    return path


def _manifest_ok(m: object) -> list[dict] | None:
    if not isinstance(m, dict) or not isinstance(m.get("files"), list) or not m["files"]:
        return None
    out = []
    for e in m["files"]:
        if not isinstance(e, dict) or safe_rel(e.get("path")) is None:
            return None
        if not isinstance(e.get("size"), int) or e["size"] < 0 or not HEX64.match(str(e.get("sha256", ""))):
            return None
        out.append(e)
    return out


def restore(url_text: str, directory: str) -> int:
    rc = Rclone(url_text)
    names = sorted((i["Path"] for i in rc.lsjson("manifests") if i["Path"].endswith(".json")),
                   reverse=True)
    if not names:
        _say(f"No checkpoint in {url_text} yet: starting fresh")
        return NOTHING
    objects = {i["Path"]: int(i["Size"]) for i in rc.lsjson("objects")}
    os.makedirs(directory, exist_ok=True)
    for name in names:
        try:
            manifest = json.loads(rc.run("cat", "--count", str(MAX_MANIFEST),
                                         remote_path(rc.url, "manifests", name)))
        except (StoreError, ValueError) as exc:
            _say(f"skipping manifest {name}: unreadable ({exc})")
            continue
        files = _manifest_ok(manifest)
        if files is None:
            _say(f"skipping manifest {name}: malformed or a path leaves the directory")
            continue
        missing = [e["path"] for e in files if objects.get(e["sha256"]) != e["size"]]
        if missing:
            _say(f"skipping manifest {name}: {len(missing)} object(s) missing or of another size")
            continue
        if _restore_one(rc, directory, files):
            step = manifest.get("step")
            label = f"step-{step:06d}" if isinstance(step, int) else name
            _say(f"Resuming from checkpoint {label} ({url_text}/manifests/{name}, "
                 f"{len(files)} files, {_size(sum(e['size'] for e in files))})")
            return 0
        _say(f"skipping manifest {name}: a download did not match its sha256")
    _say(f"No complete checkpoint in {url_text}: starting fresh")
    return NOTHING


def _restore_one(rc: Rclone, directory: str, files: list[dict]) -> bool:
    need = []
    for e in files:
        local = os.path.join(directory, e["path"])
        if os.path.isfile(local) and not os.path.islink(local) \
                and os.path.getsize(local) == e["size"] and sha256_file(local) == e["sha256"]:
            continue
        need.append(e)
    if not need:
        return True
    stage = tempfile.mkdtemp(prefix=".cts-down-", dir=os.path.dirname(os.path.abspath(directory)))
    try:
        shas = sorted({e["sha256"] for e in need})
        with open(os.path.join(stage, "list"), "w") as f:
            f.write("\n".join(shas) + "\n")
        rc.run("copy", "--transfers", str(rc.transfers), "--files-from",
               os.path.join(stage, "list"), "--no-traverse",
               remote_path(rc.url, "objects"), os.path.join(stage, "objects"))
        for sha in shas:
            got = os.path.join(stage, "objects", sha)
            if not os.path.isfile(got) or os.path.islink(got) or sha256_file(got) != sha:
                return False
        root = os.path.realpath(directory)
        for e in need:
            dst = os.path.realpath(os.path.join(directory, e["path"]))
            if not dst.startswith(root + os.sep):
                return False
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            tmp = dst + ".cts.tmp"
            shutil.copyfile(os.path.join(stage, "objects", e["sha256"]), tmp)
            os.replace(tmp, dst)
        return True
    finally:
        shutil.rmtree(stage, ignore_errors=True)


# --- command line ----------------------------------------------------------------------------

def main(argv: list[str]) -> int:
    usage = "usage: store.py fetch|restore|upload|watch URL DIR [--pid PID] [--interval S]"
    if len(argv) < 3 or argv[0] not in ("fetch", "restore", "upload", "watch"):
        print(usage, file=sys.stderr)
        return USAGE
    cmd, url, directory, rest = argv[0], argv[1], argv[2], argv[3:]
    opts = dict(zip(rest[::2], rest[1::2]))
    try:
        if cmd == "fetch":
            return fetch(url, directory)
        if cmd == "restore":
            return restore(url, directory)
        if cmd == "upload":
            return upload(url, directory)
        pid = int(opts["--pid"]) if "--pid" in opts else None
        interval = float(opts.get("--interval", os.environ.get("CLOUDTRAIN_CHECKPOINT_INTERVAL", "15")))
        return watch(url, directory, pid, interval)
    except StoreError as exc:
        print(f"[store] error: {exc}", file=sys.stderr, flush=True)
        return exc.code
    except (OSError, ValueError) as exc:
        print(f"[store] error: {exc}", file=sys.stderr, flush=True)
        return FAILED


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
