"""Docker for the tests: the Engine, two images and a loopback registry (pytest fixtures,
registered by tests/conftest.py).

- ``docker_engine``: the Engine's version; skips, saying how to start one, when none answers.
  That skip is one CI must never take (tests/skipcheck.py MUST_RUN): scripts/setup.sh --tests
  installs Docker and starts it with scripts/dockerd.sh.
- ``torch_image``: ``ct-test/torch:<hash of tests/images/build_torch.sh>``, Python 3 + PyTorch
  CPU + numpy, built once per machine (2.5 to 5 min) when missing, then found by its tag.
- ``tiny_image``: ``ct-test/tiny:<hash of its contents>``, bash, coreutils, grep and sed copied
  from the host with the libraries ``ldd`` names, ``docker import``-ed: a few MB, seconds.
- ``registry``: a ``docker-registry`` on a free 127.0.0.1 port with htpasswd (bcrypt) auth and
  storage under the session's tmp, stopped (and the images pulled from it untagged) at the end;
  ``registry.push(local_tag, repo)`` gives ``(ref, digest)``.

Builds take a machine-wide file lock (fcntl), so that under pytest-xdist, or beside another
checkout's run, one process builds and the others wait and then find the image.
``python tests/dockerkit.py torch|tiny`` builds (or finds) an image outside pytest:
``scripts/setup.sh --tests`` starts the torch build in the background when the image is
missing, and .ci/run waits for it before the tests, so that no test waits for it within its
own time limit (a test that does wait holds the lock's queue, not a second build).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parent.parent
TORCH_RECIPE = REPO / "tests" / "images" / "build_torch.sh"
NO_ENGINE = ("needs a Docker Engine: none answers on /var/run/docker.sock "
             "(start one with: bash scripts/dockerd.sh)")
NO_REGISTRY = ("needs a Docker Engine's registry and htpasswd: "
               "apt-get install docker-registry apache2-utils (scripts/setup.sh --tests does)")
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# What the tiny image holds, from the host: a shell and the everyday tools.
TINY_TOOLS = ("bash", "sleep", "cat", "echo", "ls", "mkdir", "rm", "cp", "mv", "touch", "id",
              "env", "true", "false", "head", "tail", "wc", "sort", "stat", "chmod", "ln",
              "pwd", "date", "uname", "tee", "printf", "basename", "dirname", "readlink",
              "sha256sum", "timeout", "nproc", "grep", "sed")


def docker_cli() -> str:
    """The Docker CLI the tests use: the first ``docker`` in PATH (REALPARTS: the static 28.x
    client, which talks API 1.41 to the Engine)."""
    return shutil.which("docker") or "/usr/bin/docker"


def docker(*args: str, config: Path | None = None, input: str | bytes | None = None,
           timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = [docker_cli(), *(["--config", str(config)] if config else []), *args]
    if isinstance(input, bytes):
        rb = subprocess.run(cmd, input=input, capture_output=True, timeout=timeout)
        r = subprocess.CompletedProcess(cmd, rb.returncode, rb.stdout.decode(errors="replace"),
                                        rb.stderr.decode(errors="replace"))
    else:
        r = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (exit {r.returncode}): "
                           f"{(r.stderr or r.stdout).strip()[-2000:]}")
    return r


def engine_version() -> str | None:
    """The Engine's version, or None when no Engine answers."""
    try:
        r = docker("version", "--format", "{{.Server.Version}}", timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else None


def image_exists(tag: str) -> bool:
    return docker("image", "inspect", tag, check=False, timeout=30).returncode == 0


@contextlib.contextmanager
def machine_lock(name: str) -> Iterator[None]:
    """An exclusive lock every process of this machine shares (xdist workers, other checkouts)."""
    path = Path(tempfile.gettempdir()) / f"ct-test-dockerkit-{name}.lock"
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ---- the torch image ----------------------------------------------------------------------

def torch_tag() -> str:
    return "ct-test/torch:" + hashlib.sha256(TORCH_RECIPE.read_bytes()).hexdigest()[:12]


def build_torch() -> str:
    """The torch image's tag, built by tests/images/build_torch.sh unless it exists."""
    tag = torch_tag()
    if image_exists(tag):
        return tag
    with machine_lock("torch"):
        if image_exists(tag):           # built while this process waited
            return tag
        r = subprocess.run(["bash", str(TORCH_RECIPE), tag], capture_output=True, text=True,
                           timeout=1200)
        if r.returncode != 0 or not image_exists(tag):
            raise RuntimeError(f"tests/images/build_torch.sh {tag} failed (exit {r.returncode}):"
                               f"\n{(r.stderr + r.stdout)[-3000:]}")
    return tag


# ---- the tiny image -----------------------------------------------------------------------

def _libraries(binary: str) -> list[str]:
    """The absolute paths ``ldd`` names for ``binary`` (the loader included)."""
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
    return re.findall(r"(/\S+) \(0x", out)


def _entries(paths: list[str]) -> dict[str, str | None]:
    """Every path the image needs -> the symlink's target, or None for a regular file: each
    path as named, the links on the way (``/lib64/ld-linux...``, merged /usr) and their ends."""
    found: dict[str, str | None] = {}
    for top in ("/bin", "/sbin", "/lib", "/lib64"):
        if os.path.islink(top):
            found[top] = os.readlink(top)
    todo = list(paths)
    while todo:
        p = todo.pop()
        at = os.path.join(os.path.realpath(os.path.dirname(p)), os.path.basename(p))
        if at in found:
            continue
        if os.path.islink(at):
            target = os.readlink(at)
            found[at] = target
            todo.append(os.path.join(os.path.dirname(at), target) if not target.startswith("/")
                        else target)
        else:
            found[at] = None
    return found


def tiny_content() -> dict[str, str | None]:
    binaries = [b for b in (shutil.which(t) for t in TINY_TOOLS) if b]
    libs = sorted({lib for b in binaries for lib in _libraries(b)})
    return _entries(binaries + libs)


def tiny_tag(content: dict[str, str | None]) -> str:
    h = hashlib.sha256(b"tiny-1\0")
    for path, target in sorted(content.items()):
        h.update(path.encode() + b"\0")
        h.update(target.encode() if target is not None else Path(path).read_bytes())
    return "ct-test/tiny:" + h.hexdigest()[:12]


def _tiny_tar(content: dict[str, str | None]) -> bytes:
    buf = io.BytesIO()
    dirs: set[str] = {"/tmp", "/etc", "/root"}
    for path in content:
        d = os.path.dirname(path)
        while d != "/" and not any(d == link or d.startswith(link + "/")
                                   for link, t in content.items() if t is not None):
            dirs.add(d)
            d = os.path.dirname(d)
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in sorted(dirs):
            info = tarfile.TarInfo(d.lstrip("/"))
            info.type, info.mode = tarfile.DIRTYPE, (0o1777 if d == "/tmp" else 0o755)
            tar.addfile(info)
        for name, text in (("etc/passwd", "root:x:0:0:root:/root:/bin/bash\n"),
                           ("etc/group", "root:x:0:\n")):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(text), 0o644
            tar.addfile(info, io.BytesIO(text.encode()))
        for path, target in sorted(content.items()):
            if target is not None:
                info = tarfile.TarInfo(path.lstrip("/"))
                info.type, info.linkname, info.mode = tarfile.SYMTYPE, target, 0o777
                tar.addfile(info)
            else:
                tar.add(path, arcname=path.lstrip("/"), recursive=False)
        sh = tarfile.TarInfo("usr/bin/sh" if "/usr/bin/bash" in content else "bin/sh")
        sh.type, sh.linkname, sh.mode = tarfile.SYMTYPE, "bash", 0o777
        tar.addfile(sh)
    return buf.getvalue()


def build_tiny() -> str:
    """The tiny image's tag, imported from the host's files unless it exists."""
    content = tiny_content()
    tag = tiny_tag(content)
    if image_exists(tag):
        return tag
    with machine_lock("tiny"):
        if not image_exists(tag):
            docker("import", "-c", f"ENV {PATH_ENV}", "-", tag, input=_tiny_tar(content))
    return tag


# ---- the registry -------------------------------------------------------------------------

@dataclass(frozen=True)
class Registry:
    """A loopback registry with htpasswd auth; ``host`` is ``127.0.0.1:PORT``."""
    host: str
    username: str
    password: str
    storage: Path
    scratch: Path

    def login(self, config: Path) -> None:
        """``docker login`` to this registry with its credentials, kept in ``config`` (a
        throwaway ``--config`` folder: the user's own Docker config is never touched)."""
        docker("login", "-u", self.username, "--password-stdin", self.host, config=config,
               input=self.password)

    def push(self, local_tag: str, repo: str) -> tuple[str, str]:
        """Push ``local_tag`` as ``repo`` (``name`` or ``name:tag``; ``latest`` when no tag)
        with a throwaway login; returns (``host/repo:tag``, the pushed manifest's digest)."""
        name, _, tag = repo.partition(":")
        ref = f"{self.host}/{name}:{tag or 'latest'}"
        config = Path(tempfile.mkdtemp(prefix="login-", dir=self.scratch))
        try:
            self.login(config)
            docker("tag", local_tag, ref)
            try:
                out = docker("push", ref, config=config, timeout=900).stdout
            finally:
                docker("rmi", ref, check=False)      # the tag only: local_tag keeps the image
        finally:
            shutil.rmtree(config, ignore_errors=True)
        m = re.search(r"digest: (sha256:[0-9a-f]{64})", out)
        if not m:
            raise RuntimeError(f"docker push {ref}: no digest line in its output:\n{out}")
        return ref, m.group(1)

    def local_refs(self) -> list[str]:
        """The Engine's images named after this registry (pulled from it), by tag or digest."""
        out = docker("image", "ls", "--digests", "--format",
                     "{{.Repository}} {{.Tag}} {{.Digest}}", check=False).stdout
        refs = []
        for line in out.splitlines():
            repo, tag, digest = (line.split() + ["", "", ""])[:3]
            if not repo.startswith(self.host + "/"):
                continue
            refs.append(f"{repo}:{tag}" if tag != "<none>" else f"{repo}@{digest}")
        return refs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers_401(host: str) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        opener.open(f"http://{host}/v2/", timeout=2)
    except urllib.error.HTTPError as e:
        return e.code == 401
    except OSError:
        return False
    return False


def _registry_config(root: Path, port: int) -> Path:
    conf = root / "config.yml"
    conf.write_text(
        "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n"
        f"    rootdirectory: {root / 'storage'}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: 127.0.0.1:{port}\n"
        f"auth:\n  htpasswd:\n    realm: ct-test\n    path: {root / 'htpasswd'}\n")
    return conf


@contextlib.contextmanager
def run_registry(root: Path, username: str = "ctuser",
                 password: str = "ct-Pass-0f-tests") -> Iterator[Registry]:
    """A registry serving from ``root`` until the block ends; then the images pulled from it
    are untagged and the process stopped."""
    binary = shutil.which("docker-registry")
    if binary is None or shutil.which("htpasswd") is None:
        pytest.skip(NO_REGISTRY)
    root.mkdir(parents=True, exist_ok=True)
    (root / "storage").mkdir(exist_ok=True)
    entry = subprocess.run(["htpasswd", "-Bbn", username, password], capture_output=True,
                           text=True, check=True).stdout
    (root / "htpasswd").write_text(entry)
    log = root / "registry.log"
    for _attempt in range(5):           # a port taken between the probe and the bind: again
        port = _free_port()
        with open(log, "w") as out:
            proc = subprocess.Popen([binary, "serve", str(_registry_config(root, port))],
                                    stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        host = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while proc.poll() is None and time.monotonic() < deadline and not _answers_401(host):
            time.sleep(0.05)
        if proc.poll() is None and _answers_401(host):
            break
        proc.kill()
        proc.wait()
    else:
        raise RuntimeError(f"docker-registry did not start; its log:\n{log.read_text()[-2000:]}")
    reg = Registry(host, username, password, root / "storage", root)
    try:
        yield reg
    finally:
        for ref in reg.local_refs():
            docker("rmi", ref, check=False)
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- the fixtures -------------------------------------------------------------------------

@pytest.fixture(scope="session")
def docker_engine() -> str:
    version = engine_version()
    if version is None:
        pytest.skip(NO_ENGINE)
    return version


@pytest.fixture(scope="session")
def torch_image(docker_engine: str) -> str:
    return build_torch()


@pytest.fixture(scope="session")
def tiny_image(docker_engine: str) -> str:
    return build_tiny()


@pytest.fixture(scope="session")
def registry(docker_engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    with run_registry(tmp_path_factory.mktemp("registry")) as reg:
        yield reg


if __name__ == "__main__":
    args = sys.argv[1:]
    what = args[0] if args else ""
    if what not in ("torch", "tiny") or args[1:] not in ([], ["--check"]):
        sys.exit("usage: python tests/dockerkit.py torch|tiny [--check]\n"
                 "  builds the image unless present (waiting for a build in progress) and prints"
                 " its tag;\n  --check: exit 0 when it is there, 1 when not")
    if engine_version() is None:
        sys.exit(NO_ENGINE)
    if args[1:] == ["--check"]:
        sys.exit(0 if image_exists(torch_tag() if what == "torch" else tiny_tag(tiny_content()))
                 else 1)
    print(build_torch() if what == "torch" else build_tiny())
