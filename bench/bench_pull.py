#!/usr/bin/env python3
"""First pull of a ~1 GB image from a loopback registry: 1 node vs N nodes at once.

1. an image with a layer of its own (not shared with any image on this machine, so the pull
   downloads and extracts all of it): the filesystem of ``--base`` (default the tests' torch
   image, ct-test/torch:dev, about 1.05 GB) exported from a container, a file with this run's
   id added, and ``docker import``-ed as ``ct-test/pullbench:<id>``;
2. a registry on 127.0.0.1 (Debian's ``docker-registry``, htpasswd login), the image pushed
   into it (the first push compresses the layer: about a minute on two cores), the local
   image removed;
3. for each node count: ``cloudtrain launch`` of a task with ``container.image`` on a new local
   cluster of that many nodes, the login in ``container.registry_auth``; the time is the
   launch's own "pulled on N of N node(s) in X s" (every node's pull, all at once), and the
   launch's wall time; then ``down`` (which removes what cloudtrain pulled, so the next count
   pulls from scratch again; checked).

Local nodes share this machine's one Docker Engine: N nodes pulling at once are N requests
to the same Engine, which downloads each layer once and lets the others wait for it. So the
N-node figure here shows cloudtrain's fan-out overhead (N SSH sessions, N progress streams,
one shared download), not N machines each pulling over their own network: on a real cluster
every node downloads the image itself, in parallel, and the time is that of the slowest node.

    python bench/bench_pull.py [--nodes 1,4] [--base ct-test/torch:dev]

Everything is removed at the end (clusters, registry, its storage, the images it made), on
Ctrl-C and SIGTERM too.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import begin, cloudtrain_cmd, ct_env, iter_csv_ints, run_counts, table, timed_lines

PULLED_RE = re.compile(r"pulled on (\d+) of (\d+) node\(s\) in ([0-9.]+) s")


def docker(*args: str, stdin: bytes | None = None, check: bool = True) -> str:
    r = subprocess.run(["docker", *args], input=stdin, capture_output=True, timeout=1800)
    if check and r.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:3])}: {r.stderr.decode(errors='replace')}")
    return r.stdout.decode(errors="replace")


def make_image(base: str, tag: str, root: Path) -> int:
    """``base``'s filesystem plus one file of this run's own, imported as ``tag``; its size."""
    cid = docker("create", "--entrypoint", "/bin/sh", base).strip()
    try:
        tar = root / "fs.tar"
        with open(tar, "wb") as f:
            subprocess.run(["docker", "export", cid], stdout=f, check=True, timeout=1800)
    finally:
        docker("rm", "-f", cid, check=False)
    extra = root / "extra"
    extra.mkdir()
    (extra / "pullbench-id").write_text(tag + "\n")
    subprocess.run(["tar", "-C", str(extra), "-rf", str(tar), "pullbench-id"], check=True)
    with open(tar, "rb") as f:
        subprocess.run(["docker", "import", "-", tag], stdin=f, check=True, capture_output=True,
                       timeout=1800)
    tar.unlink()
    return int(docker("image", "inspect", "--format", "{{.Size}}", tag).strip())


def start_registry(root: Path, password: str) -> tuple[subprocess.Popen[bytes], str]:
    htpasswd = subprocess.run(["htpasswd", "-Bbn", "bench", password], capture_output=True,
                              text=True, check=True).stdout
    (root / "htpasswd").write_text(htpasswd)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (root / "registry.yml").write_text(
        f"version: 0.1\nstorage: {{filesystem: {{rootdirectory: {root}/registry}}}}\n"
        f"http: {{addr: 127.0.0.1:{port}}}\nauth: {{htpasswd: {{realm: bench, path: "
        f"{root}/htpasswd}}}}\n")
    proc = subprocess.Popen(["docker-registry", "serve", str(root / "registry.yml")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("the registry did not start")


def push(local: str, host: str, password: str, root: Path) -> tuple[str, float]:
    ref = f"{host}/ct-test/pullbench:1"
    cfg = root / "dockercfg"
    cfg.mkdir(exist_ok=True)
    subprocess.run(["docker", "--config", str(cfg), "login", "-u", "bench", "--password-stdin",
                    host], input=password.encode(), capture_output=True, check=True)
    docker("tag", local, ref)
    t = time.monotonic()
    docker("--config", str(cfg), "push", ref)
    took = time.monotonic() - t
    docker("image", "rm", ref, local)
    return ref, took


def launch(home: Path, root: Path, ref: str, n: int, password: str) -> tuple[float, float]:
    task = root / f"pull{n}.yaml"
    task.write_text(f"name: pull{n}\nnum_nodes: {n}\nresources: {{provider: local}}\n"
                    f"container:\n  image: {ref}\n"
                    "  registry_auth: {username_env: BENCH_USER, password_env: BENCH_KEY}\n"
                    "run: 'true'\n")
    env = {**ct_env(home), "BENCH_USER": "bench", "BENCH_KEY": password}
    code, t0, t1, lines = timed_lines(cloudtrain_cmd() + ["launch", str(task)], env)
    text = "\n".join(line for _, line in lines)
    m = PULLED_RE.search(text)
    if code != 0 or m is None:
        raise RuntimeError(f"launch on {n} node(s) exited {code}:\n{text[-3000:]}")
    return float(m.group(3)), t1 - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="1,4")
    ap.add_argument("--base", default="ct-test/torch:dev")
    args = ap.parse_args()
    counts = list(iter_csv_ints(args.nodes))
    root, home = begin("ct-bench-pull-", "first pull of a ~1 GB image: 1 node vs N nodes")
    run_id = uuid.uuid4().hex[:8]
    local = f"ct-test/pullbench:{run_id}"
    password = uuid.uuid4().hex
    reg: subprocess.Popen[bytes] | None = None
    state: dict[str, str] = {}

    def prepare() -> None:
        nonlocal reg
        t = time.monotonic()
        size = make_image(args.base, local, root)
        print(f"# image: {size / 1e9:.2f} GB ({args.base} + one file), made in "
              f"{time.monotonic() - t:.0f} s", flush=True)
        reg, host = start_registry(root, password)
        state["ref"], took = push(local, host, password, root)
        print(f"# pushed to the loopback registry in {took:.0f} s", flush=True)

    def per_count(n: int) -> tuple[int, float, float]:
        pulled, wall = launch(home, root, state["ref"], n, password)
        return n, pulled, wall

    results: list[tuple[int, float, float]] = []
    interrupted = False
    try:
        results, interrupted = run_counts(root, home, counts, per_count, lambda n: f"pull{n}",
                                          keep_files=True, prepare=prepare)
        if state.get("ref") and subprocess.run(["docker", "image", "inspect", state["ref"]],
                                               capture_output=True).returncode == 0:
            print("# WARNING: down left the pulled image behind", flush=True)
    finally:
        if reg is not None:
            os.killpg(reg.pid, signal.SIGTERM)
            reg.wait(30)
        for ref in (state.get("ref", ""), local):
            if ref:
                docker("image", "rm", ref, check=False)
        subprocess.run(["rm", "-rf", str(root)], check=False)
    print(table(["nodes", "pull (all nodes) s", "launch wall s"],
                [[n, f"{p:.1f}", f"{w:.1f}"] for n, p, w in results]))
    print("# local nodes share one Docker Engine: N nodes = one download, N requests")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
