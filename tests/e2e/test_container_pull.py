"""Pulling the task's image through the real CLI on local nodes (their SSH sessions reach this
machine's Docker Engine), from a real registry on loopback (Debian's docker-registry, htpasswd
login): the pull on every node with each node's progress shown, the login sent as the Engine
API's header and written nowhere, the digest recorded on the launch and shown by status, a
refused login and a pull failing on one node (the launch stops, names it, and rolls back the
cluster it created), and what ``down`` removes again (only what cloudtrain pulled, not with
``keep_image``, never an image that was there before; a digest-pinned image found on the node
is not pulled again).

Local nodes share one Docker Engine: two nodes pulling at once is one pull for the Engine,
and an image one node pulled is there for the next. A node whose pulls fail is one whose shell
points DOCKER_HOST (its .bashrc, as rootless Docker's setup writes it) at a socket that passes
everything to this machine's Engine but answers a pull as an Engine with a full disk."""

from __future__ import annotations

import base64
import json
import re
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from conftest import CLI, needs_sshd

pytestmark = [needs_sshd, pytest.mark.e2e]

USER_VAR, KEY_VAR = "CT_PULL_USER", "CT_PULL_KEY"


def _docker(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=300,
                          check=check)


def _present(ref: str) -> bool:
    return _docker("image", "inspect", ref, check=False).returncode == 0


@pytest.fixture
def pushed(registry, tiny_image, tmp_path):  # type: ignore[no-untyped-def]
    """An image of this test's own (the tiny image and a file naming it: no container of
    anyone else's uses it) pushed under a repository of its own, no local tag left (the nodes
    must pull it); removed again at the end whatever the test left."""
    uid = uuid.uuid4().hex[:8]
    src, box = f"ct-test/pull-src:{uid}", f"ct-test-pull-{uid}"
    (tmp_path / "pull-id").write_text(uid + "\n")
    _docker("create", "--name", box, "--network", "none", tiny_image, "true")
    try:
        _docker("cp", str(tmp_path / "pull-id"), f"{box}:/pull-id")
        _docker("commit", box, src)
    finally:
        _docker("rm", "-f", box, check=False)
    ref, digest = registry.push(src, f"ct-test/pull-{uid}")   # (the pushed tag is untagged)
    _docker("image", "rm", src)
    assert not _present(ref)
    yield ref, digest
    _docker("image", "rm", ref, check=False)
    _docker("image", "rm", ref.rsplit(":", 1)[0] + "@" + digest, check=False)


def _task(tmp_path: Path, name: str, image: str, *, auth: bool = True, extra: str = "") -> Path:
    p = tmp_path / f"{name}.yaml"
    login = f"  registry_auth: {{username_env: {USER_VAR}, password_env: {KEY_VAR}}}\n" if auth else ""
    p.write_text(f"name: {name}\nnum_nodes: 2\nresources: {{provider: local}}\n"
                 f"container:\n  image: {image}\n{login}{extra}"
                 "run: echo \"ran on $CLOUDTRAIN_NODE_RANK\"\n")
    return p


def _login(registry) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {USER_VAR: registry.username, KEY_VAR: registry.password}


def _secrets(registry) -> list[str]:  # type: ignore[no-untyped-def]
    pw, user = registry.password, registry.username
    return [pw, base64.b64encode(pw.encode()).decode(),
            base64.b64encode(f"{user}:{pw}".encode()).decode(),
            base64.urlsafe_b64encode(pw.encode()).decode().rstrip("=")]


def _no_secret_under(paths: list[Path], secrets: list[str]) -> None:
    for root in paths:
        if not root.exists():
            continue
        files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
        for f in files:
            data = f.read_bytes()
            for s in secrets:
                assert s.encode() not in data, f"a secret of the login is in {f}"


def _repo_digest(ref: str, digest: str) -> str:
    return ref.rsplit(":", 1)[0] + "@" + digest


def test_pull_shows_progress_records_the_digest_and_down_removes_it(
        cli: CLI, tmp_path: Path, registry, pushed) -> None:  # type: ignore[no-untyped-def]
    ref, digest = pushed
    r = cli.run("launch", str(_task(tmp_path, "pull", ref)), **_login(registry))
    assert r.returncode == 0, r.stderr
    assert "ran on 0" in r.stdout and "ran on 1" in r.stdout
    # Each node's progress, then the digest the registry served.
    assert f"node-0: pulling {ref}" in r.stderr or f"node-1: pulling {ref}" in r.stderr
    assert " layers, " in r.stderr and "/s" in r.stderr
    assert f"Image {ref} pulled on" in r.stderr and _repo_digest(ref, digest) in r.stderr
    assert _present(ref)

    # The launch's ledger entry and status show it.
    st = cli.run("status")
    assert f"pull: image {ref}, digest {_repo_digest(ref, digest)} on every node" in st.stdout
    (entry,) = [c for c in cli.status() if c["name"] == "pull"]
    image = entry["image"]
    assert isinstance(image, dict)
    assert image["image"] == ref and image["digest"] == _repo_digest(ref, digest)

    # The login went to the Engine in a header: nothing of it on disk here or on the nodes.
    _no_secret_under([cli.home, Path.home() / ".docker"], _secrets(registry))
    assert registry.password not in r.stdout + r.stderr + st.stdout + st.stderr

    d = cli.run("down", "pull", "-y")
    assert d.returncode == 0, d.stderr
    assert f"removed image {ref}" in d.stderr
    assert not _present(ref)


def test_a_refused_login_exits_2_naming_registry_auth_and_rolls_back(
        cli: CLI, tmp_path: Path, registry, pushed) -> None:  # type: ignore[no-untyped-def]
    ref, _ = pushed
    wrong = "not-" + registry.password
    r = cli.run("launch", str(_task(tmp_path, "refused", ref)),
                **{USER_VAR: registry.username, KEY_VAR: wrong})
    assert r.returncode == 2, r.stderr
    err = " ".join(r.stderr.split())
    assert "container.registry_auth" in err and "refused the login" in err
    assert f"${USER_VAR} / ${KEY_VAR}" in err and "Traceback" not in err
    assert "Rolling back" in err
    assert wrong not in r.stdout + r.stderr
    _no_secret_under([cli.home, Path.home() / ".docker"],
                     [wrong, base64.b64encode(f"{registry.username}:{wrong}".encode()).decode()])
    assert not (cli.home / "clusters" / "refused").exists()
    assert not _present(ref)

    # No login at all for a registry that asks for one: the same field, and what to add.
    r = cli.run("launch", str(_task(tmp_path, "nologin", ref, auth=False)))
    assert r.returncode == 2, r.stderr
    assert "container.registry_auth" in r.stderr and "without a login" in r.stderr


class FailingPulls:
    """A Docker Engine socket for one node: every request goes through to this machine's
    Engine, except a pull, which it answers as an Engine whose disk is full does."""

    REASON = "write /var/lib/docker/tmp/GetImageBlob: no space left on device"

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(self.path)
        self.server.listen(16)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            head = conn.recv(65536)
            if re.match(rb"POST /v[0-9.]+/images/create", head):
                body = json.dumps({"message": self.REASON}).encode()
                conn.sendall(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: "
                             b"application/json\r\nContent-Length: " + str(len(body)).encode()
                             + b"\r\nConnection: close\r\n\r\n" + body)
                return
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as engine:
                engine.connect("/var/run/docker.sock")
                engine.sendall(head)
                back = threading.Thread(target=_pump, args=(engine, conn), daemon=True)
                back.start()
                _pump(conn, engine)
                back.join(30)

    def close(self) -> None:
        self.server.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def test_a_pull_failing_on_one_node_names_it_and_rolls_back(
        cli: CLI, tmp_path: Path, registry, pushed) -> None:  # type: ignore[no-untyped-def]
    ref, _ = pushed
    # Node 1's shell points Docker clients at an Engine whose pulls fail (its .bashrc, as
    # rootless Docker's setup writes DOCKER_HOST); everything else it answers as usual.
    engine = FailingPulls(tmp_path / "engine1.sock")
    root1 = cli.home / "clusters" / "onebad" / "local" / "nodes" / "1" / "root"
    root1.mkdir(parents=True)
    (root1 / ".bashrc").write_text(f"export DOCKER_HOST=unix://{engine.path}\n")
    try:
        r = cli.run("launch", str(_task(tmp_path, "onebad", ref)), **_login(registry))
    finally:
        engine.close()
    assert r.returncode == 1, r.stderr
    err = " ".join(r.stderr.split())
    assert f"could not get {ref} on 1 of 2 node(s): node 1: {FailingPulls.REASON}." in err, err
    assert "Rolling back" in err and "Traceback" not in err
    assert not (cli.home / "clusters" / "onebad").exists()
    assert cli.run("status").stdout.strip() == "No clusters."
    # What node 0 pulled for the cluster went with it.
    assert f"node-0: pulling {ref}" in r.stderr
    assert not _present(ref)


def test_a_pinned_image_is_not_pulled_again_and_keep_image_keeps_it(
        cli: CLI, tmp_path: Path, registry, pushed) -> None:  # type: ignore[no-untyped-def]
    ref, digest = pushed
    pinned = _repo_digest(ref, digest)
    task = _task(tmp_path, "keep", pinned, extra="  keep_image: true\n")
    r = cli.run("launch", str(task), **_login(registry))
    assert r.returncode == 0, r.stderr
    assert f"Image {pinned} pulled on" in r.stderr
    assert cli.run("down", "keep", "-y").returncode == 0
    assert _present(pinned), "keep_image: true, yet down removed the image"

    # Found on the node: not pulled again (no login needed, none is sent), recorded the same.
    r = cli.run("launch", str(_task(tmp_path, "again", pinned, auth=False)))
    assert r.returncode == 0, r.stderr
    assert "pulling" not in r.stderr
    assert f"Image {pinned} already on every node: {pinned}" in r.stderr
    launches = json.loads(cli.run("status", "--json").stdout)
    assert [c["image"]["digest"] for c in launches if c["name"] == "again"] == [pinned]
    # It was there before this cluster: down leaves it.
    d = cli.run("down", "again", "-y")
    assert d.returncode == 0 and "removed image" not in d.stderr
    assert _present(pinned)



def test_down_on_an_ssh_host_removes_only_what_cloudtrain_pulled_and_nobody_uses(
        cli: CLI, tmp_path: Path, registry, pushed, tiny_image) -> None:  # type: ignore[no-untyped-def]
    ref, _ = pushed
    # The user's host: a local node (its sshd), reached by the ssh provider.
    (tmp_path / "hosts.yaml").write_text("name: hosts\nresources: {provider: local}\nrun: 'true'\n")
    assert cli.run("up", str(tmp_path / "hosts.yaml"), "--no-bootstrap", "-y").returncode == 0
    (host,) = [c for c in cli.status() if c["name"] == "hosts"][0]["nodes"]  # type: ignore[index]
    key = cli.home / "clusters" / "hosts" / "ssh" / "id_ed25519"
    # An image the user had before, under a name of the same registry.
    before = f"{registry.host}/ct-test/before-{uuid.uuid4().hex[:8]}:1"
    _docker("tag", tiny_image, before)
    user_container = f"ct-test-pull-user-{uuid.uuid4().hex[:8]}"

    def on_host(name: str, image: str) -> Path:
        p = tmp_path / f"{name}.yaml"
        p.write_text(f"name: {name}\nresources:\n  provider: ssh\n  ssh:\n    hosts:\n      - "
                     f"{{address: {host['host']}, port: {host['port']}, identity_file: {key}}}\n"
                     f"bootstrap: {{python: {sys.executable}}}\n"
                     f"container:\n  image: {image}\n  registry_auth: {{username_env: "
                     f"{USER_VAR}, password_env: {KEY_VAR}}}\nrun: 'true'\n")
        return p

    try:
        r = cli.run("launch", str(on_host("pulls", ref)), "-y", **_login(registry))
        assert r.returncode == 0 and f"Image {ref} pulled on 1 of 1" in r.stderr, r.stderr
        r = cli.run("launch", str(on_host("finds", before)), "-y", **_login(registry))
        assert r.returncode == 0 and f"Image {before} already on the node" in r.stderr, r.stderr

        d = cli.run("down", "finds", "-y")
        assert d.returncode == 0 and "removed image" not in d.stderr, d.stderr
        assert _present(before)

        # A container of the user's uses the image cloudtrain pulled: Docker refuses, it stays.
        _docker("create", "--name", user_container, "--network", "none", ref, "true")
        d = cli.run("down", "pulls", "-y")
        assert d.returncode == 0, d.stderr
        cid = _docker("inspect", "--format", "{{.Id}}", user_container).stdout.strip()
        assert f"node-0: kept image {ref}: used by container(s) {cid[:12]}" in d.stderr, d.stderr
        assert _present(ref)
    finally:
        _docker("rm", "-f", user_container, check=False)
        _docker("image", "rm", before, check=False)
