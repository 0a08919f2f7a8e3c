from __future__ import annotations

import getpass
import hashlib
import json
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from cloudtrain.errors import ProviderError, UserError
from cloudtrain.provider import (ClusterRequest, NetworkRef, Node, NodeHealth, Plan,
                                 ProviderCheck, ProviderContext, SelfStop)

from . import netns, sshd

MAX_LOCAL_NODES = 64


class LocalOptions(BaseModel):
    """``resources.local`` in a task file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    network: Literal["loopback", "netns"] = "loopback"
    python: str | None = Field(
        None, description="Python of the environment the nodes use (default: cloudtrain's own).")
    price_per_hour: float = Field(
        0.0, ge=0, le=100_000, allow_inf_nan=False,
        description="Pretend price per node-hour in USD, for trying budgets (default 0).")
    gpus: int | None = Field(
        None, ge=1, le=64,
        description="GPU slots per node, a test and demo aid: the node's queue runs that many "
                    "gpus_per_job: 1 jobs at once, each with its own CUDA_VISIBLE_DEVICES "
                    "(the nodes have no GPUs; default: the node's real GPUs, 1 slot without).")

    @field_validator("python")
    @classmethod
    def _python(cls, v: str | None) -> str | None:
        if v is not None and (not v.startswith("/") or len(v.encode("utf-8", "surrogatepass"))
                              > 4096 or any(ord(c) < 32 or ord(c) == 127 for c in v)):
            raise ValueError("give the absolute path of a python on this machine (at most 4096 "
                             "bytes, no control characters), e.g. /opt/venv/bin/python")
        return v


def _free_port(address: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


class LocalProvider:
    name: ClassVar[str] = "local"
    options_model: ClassVar[type[BaseModel] | None] = LocalOptions
    allows_absolute_mounts: ClassVar[bool] = False
    powers_off: ClassVar[bool] = True
    list_is_cheap: ClassVar[bool] = True

    def __init__(self, ctx: ProviderContext) -> None:
        self.ctx = ctx

    def check_access(self, timeout: float) -> ProviderCheck:
        """``cloudtrain check``: nothing to sign in to; nodes are sshd processes here."""
        has_sshd = shutil.which("sshd") is not None or Path("/usr/sbin/sshd").exists()
        return ProviderCheck("local", True, "none needed", True, ("this machine",),
                             "" if has_sshd else "no OpenSSH server (sshd) found",
                             "" if has_sshd else "Install OpenSSH's server (e.g. apt-get "
                                                 "install openssh-server) to run local nodes.")

    # --- helpers ---------------------------------------------------------------------------

    def _dir(self, cluster: str) -> Path:
        return self.ctx.cluster_dir(cluster) / "local"

    def _layout_file(self, cluster: str) -> Path:
        return self._dir(cluster) / "layout.json"

    def _read_layout(self, cluster: str) -> dict[str, Any] | None:
        try:
            return json.loads(self._layout_file(cluster).read_text())
        except (OSError, ValueError):
            return None

    def _tag(self, cluster: str) -> str:
        return hashlib.sha256(f"{self.ctx.home.resolve()}:{cluster}".encode()).hexdigest()[:6]

    def _options(self, request: ClusterRequest) -> LocalOptions:
        opts = request.options
        return opts if isinstance(opts, LocalOptions) else LocalOptions()

    # --- contract --------------------------------------------------------------------------

    def check(self, request: ClusterRequest) -> None:
        res = request.resources
        if request.num_nodes > MAX_LOCAL_NODES:
            raise UserError(f"num_nodes {request.num_nodes} is more than the local provider runs "
                            f"({MAX_LOCAL_NODES}).", "Use fewer nodes, or a cloud provider.")
        if res.accelerators is not None:
            raise UserError(
                f"resources.accelerators asks for {res.accelerators}, but local nodes have no GPUs "
                "of their own.", "Remove 'accelerators' to run on CPU locally, or pick a cloud "
                "provider (resources.provider: aws | gcp | azure).")
        if res.use_spot:
            raise UserError("resources.use_spot does not apply to the local provider.",
                            "Remove 'use_spot' or pick a cloud provider.")
        opts = self._options(request)
        if opts.network == "netns":
            netns.require()
        if opts.python and not os.access(opts.python, os.X_OK):
            raise UserError(f"resources.local.python '{opts.python}' is not an executable.",
                            "Give the path of a python binary, e.g. /opt/venv/bin/python.")
        sshd.find_sshd()
        layout = self._read_layout(request.name)
        if layout is not None and len(layout["nodes"]) != request.num_nodes:
            raise UserError(
                f"local cluster '{request.name}' already has {len(layout['nodes'])} node(s); the "
                f"task asks for {request.num_nodes}.",
                f"Take it down first ('cloudtrain down {request.name}') or use another name (-c).")
        if layout is not None and layout.get("network") != opts.network:
            raise UserError(
                f"local cluster '{request.name}' runs with network '{layout.get('network')}'; the "
                f"task asks for '{opts.network}'.",
                f"Take it down first ('cloudtrain down {request.name}') or use another name (-c).")

    def plan(self, request: ClusterRequest) -> Plan:
        opts = self._options(request)
        creates = [f"{request.num_nodes} sshd node(s) under {self._dir(request.name)}"]
        if opts.network == "netns":
            creates += [f"bridge ctbr{self._tag(request.name)} on a /24 of 10.213.0.0/16",
                        f"{request.num_nodes} network namespace(s) with a veth each"]
        else:
            creates.append("one loopback address (127.x.y.z) per node")
        return Plan(provider="local", num_nodes=request.num_nodes, region="this machine",
                    instance_type="local-cpu", hourly_price_per_node=opts.price_per_hour,
                    creates=creates,
                    notes=["local nodes share this machine's CPUs, memory and disk"])

    def ensure_network(self, request: ClusterRequest) -> NetworkRef:
        opts = self._options(request)
        layout = self._read_layout(request.name)
        tag = self._tag(request.name)
        if layout is None:
            d = self._dir(request.name)
            d.mkdir(parents=True, exist_ok=True)
            h = int(tag, 16)
            if opts.network == "netns":
                subnet = netns.pick_subnet(h % 256)
                addrs = [netns.Layout(tag, subnet).address(r) for r in range(request.num_nodes)]
                ports = [22] * request.num_nodes
            else:
                subnet = f"127.{64 + h % 128}.{(h >> 8) % 256}.0/24"
                base = subnet.rsplit(".", 1)[0]
                addrs = [f"{base}.{10 + r}" for r in range(request.num_nodes)]
                ports = [_free_port(a) for a in addrs]
            layout = {
                "network": opts.network, "tag": tag, "subnet": subnet, "user": getpass.getuser(),
                "marker": f"{tag}-{request.name}",
                "python": opts.python or sys.executable,
                "gpus": opts.gpus,
                # torchrun's TCPStore listens on every address: a port free on all of them
                "master_port": 29500 if opts.network == "netns" else _free_port("0.0.0.0"),
                "nodes": [{"rank": r, "address": a, "port": p}
                          for r, (a, p) in enumerate(zip(addrs, ports))],
            }
            tmp = self._layout_file(request.name).with_suffix(".tmp")
            tmp.write_text(json.dumps(layout, indent=1))
            tmp.replace(self._layout_file(request.name))
        if layout["network"] == "netns":
            netns.create_bridge(netns.Layout(str(layout["tag"]), str(layout["subnet"])))
            return NetworkRef(f"ctbr{layout['tag']}", f"bridge ctbr{layout['tag']} {layout['subnet']}")
        return NetworkRef("lo", f"loopback {layout['subnet']}")

    def create_nodes(self, request: ClusterRequest, network: NetworkRef) -> list[Node]:
        layout = self._read_layout(request.name)
        if layout is None:
            raise ProviderError("ensure_network must run before create_nodes.")
        is_netns = layout["network"] == "netns"
        nl = netns.Layout(str(layout["tag"]), str(layout["subnet"])) if is_netns else None
        if nl is not None:
            netns.write_hosts(nl, len(layout["nodes"]),
                              [f"{request.name}-node-{r}" for r in range(len(layout["nodes"]))])
        for spec in layout["nodes"]:
            rank = int(spec["rank"])
            node_dir = self._dir(request.name) / "nodes" / str(rank)
            (node_dir / "root").mkdir(parents=True, exist_ok=True)
            sshd.write_host_key(node_dir / "ssh_host_ed25519_key")
            (node_dir / "authorized_keys").write_text(request.public_key.strip() + "\n")
            sshd.write_config(node_dir, address=spec["address"], port=int(spec["port"]),
                              user=str(layout["user"]), marker=str(layout["marker"]),
                              home=node_dir / "root")
            if nl is not None:
                netns.create_node(nl, rank)
            if sshd.pid(node_dir) is None:
                sshd.start(node_dir, nl.namespace(rank) if nl else None)
        return self.list_nodes(request.name)

    def list_nodes(self, cluster: str) -> list[Node]:
        layout = self._read_layout(cluster)
        if layout is None:
            return []
        is_netns = layout["network"] == "netns"
        nl = netns.Layout(str(layout["tag"]), str(layout["subnet"])) if is_netns else None
        nodes = []
        for spec in layout["nodes"]:
            rank = int(spec["rank"])
            node_dir = self._dir(cluster) / "nodes" / str(rank)
            alive = sshd.pid(node_dir) is not None
            if nl is not None and not netns.namespace_exists(nl.namespace(rank)):
                alive = False
            pub = node_dir / "ssh_host_ed25519_key.pub"
            host_keys = (" ".join(pub.read_text().split()[:2]),) if pub.exists() else ()
            nodes.append(Node(
                rank=rank, instance_id=f"local-{layout['tag']}-{rank}", host=str(spec["address"]),
                port=int(spec["port"]), user=str(layout["user"]), internal_ip=str(spec["address"]),
                status="running" if alive else "stopped", host_keys=host_keys,
                root_dir=str(node_dir / "root"),
            ))
        return nodes

    def master_port(self, cluster: str) -> int:
        layout = self._read_layout(cluster) or {}
        return int(layout.get("master_port") or 29500)

    def node_env(self, cluster: str) -> dict[str, str]:
        """Hints for bootstrap: local nodes use an existing Python environment, and have the
        GPU slots ``resources.local.gpus`` declares (CLOUDTRAIN_SLOTS)."""
        layout = self._read_layout(cluster) or {}
        env = {"CLOUDTRAIN_PYTHON": str(layout.get("python") or sys.executable)}
        if layout.get("gpus"):   # resources.local.gpus: the declared GPU slot count
            env["CLOUDTRAIN_SLOTS"] = str(int(layout["gpus"]))
        return env

    # --- node health (the recovery controller's evidence) ----------------------------------

    def node_health(self, cluster: str) -> list[NodeHealth]:
        """The local "cloud": a node is lost when its sshd process has exited (whatever SSH
        says: a node whose sshd is alive but does not answer is running)."""
        out = []
        for n in self.list_nodes(cluster):
            if n.status == "running":
                out.append(NodeHealth(n.rank, n.instance_id, "running"))
                continue
            stopped = (Path(n.root_dir) / ".cloudtrain" / "guard" / "stopped.json").exists()
            why = ("the node stopped itself (its guard)" if stopped
                   else "sshd exited (the local 'cloud' took the node)")
            out.append(NodeHealth(n.rank, n.instance_id, "lost", why))
        return out

    def discard_nodes(self, cluster: str, ranks: list[int]) -> None:
        """What is left of lost local nodes: their processes (the cluster's marker and the
        node's HOME) and their folder (disk, host key), so create_nodes makes new ones."""
        layout = self._read_layout(cluster)
        if layout is None:
            return
        marker = str(layout["marker"])
        for rank in ranks:
            node_dir = self._dir(cluster) / "nodes" / str(int(rank))
            sshd.stop(node_dir)
            sshd.kill_marked(marker, home=node_dir / "root")
            if layout["network"] == "netns":
                nl = netns.Layout(str(layout["tag"]), str(layout["subnet"]))
                netns.delete_node(nl, int(rank))
            _remove_tree(node_dir)

    # --- stop / start (cloudtrain stop; create_nodes starts a stopped node's sshd) -----------

    def stop_nodes(self, cluster: str) -> None:
        """A local node 'powers off' and keeps its disk: its sshd and every process of the
        cluster on it end; its folder (files, host key) stays."""
        from .stopstart import stop_nodes

        layout = self._read_layout(cluster)
        if layout is not None:
            stop_nodes(self._dir(cluster) / "nodes", layout)

    def stopped_still_bills(self, cluster: str) -> str:
        return ("Nothing bills: local nodes cost nothing; their files stay under "
                "CLOUDTRAIN_HOME until 'cloudtrain down'.")

    # --- self-stop (the node guard's last act) ----------------------------------------------

    def self_stop_command(self, cluster: str, node: Node) -> str:
        """A local node 'powers off': every process of the cluster on that node (found by the
        cluster's marker and the node's HOME in their environment) and the node's sshd end."""
        layout = self._read_layout(cluster) or {}
        node_dir = Path(node.root_dir).parent
        return sshd.stop_node_command(str(layout.get("marker", f"{self._tag(cluster)}-{cluster}")),
                                      node_dir)

    def what_still_bills(self) -> str:
        return ("Nothing: local nodes cost nothing; their folders under CLOUDTRAIN_HOME are "
                "removed at the next CLI contact.")

    def self_stopped(self, cluster: str) -> list[SelfStop]:
        out = []
        for n in self.list_nodes(cluster):
            if n.status == "running":
                continue        # still stopping (its jobs' grace), or started again
            try:
                data = json.loads((Path(n.root_dir) / ".cloudtrain" / "guard" / "stopped.json")
                                  .read_text())
                at = float(data["at"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            reason = data.get("reason")
            out.append(SelfStop(rank=n.rank, instance_id=n.instance_id, stopped_at=at,
                                reason=reason if isinstance(reason, str) else None))
        return out

    def terminate(self, cluster: str) -> None:
        d = self._dir(cluster)
        layout = self._read_layout(cluster)
        if layout is None:
            # The layout is gone (files deleted by hand, a crash): the nodes' sshd and what
            # runs under them still carry the marker, which depends only on home and name.
            for p in sshd.sshd_under(d / "nodes"):
                try:
                    os.kill(p, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            left = sshd.kill_marked(f"{self._tag(cluster)}-{cluster}")
            deadline = time.monotonic() + 10
            while sshd.sshd_under(d / "nodes") and time.monotonic() < deadline:
                time.sleep(0.05)
            left += sshd.sshd_under(d / "nodes")
            _remove_tree(d)
            self._remove_orphans(cluster)
            if left:
                raise ProviderError(
                    f"local cluster '{cluster}' was not fully removed: "
                    + ", ".join(f"process {p}" for p in left) + ".",
                    "Run 'cloudtrain down' again; if it persists, kill them by hand.")
            return
        nodes = layout["nodes"]
        for spec in nodes:
            sshd.stop(d / "nodes" / str(spec["rank"]))
        left = sshd.kill_marked(str(layout["marker"]))
        nl = None
        if layout["network"] == "netns":
            nl = netns.Layout(str(layout["tag"]), str(layout["subnet"]))
            for spec in nodes:
                ns = nl.namespace(int(spec["rank"]))
                for p in netns.namespace_pids(ns):
                    try:
                        os.kill(p, 9)
                    except ProcessLookupError:
                        pass
                netns.delete_node(nl, int(spec["rank"]))
            netns.delete_bridge(nl)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            alive = [s for s in nodes if sshd.pid(d / "nodes" / str(s["rank"])) is not None]
            if not alive:
                break
            time.sleep(0.05)
        _remove_tree(d)
        problems = [f"process {p}" for p in left]
        if nl is not None:
            problems += netns.leftovers(nl, len(nodes))
        if d.exists():
            problems.append(f"directory {d}")
        if problems:
            raise ProviderError(f"local cluster '{cluster}' was not fully removed: "
                                + ", ".join(problems) + ".",
                                "Run 'cloudtrain down' again; if it persists, remove them by hand.")

    def _remove_orphans(self, cluster: str) -> None:
        # Namespaces/bridge named by this cluster's tag but without a layout file (a crash
        # between creating them and writing the layout): find them by name and remove them.
        if netns.available() is not None:
            return
        tag = self._tag(cluster)
        nl = netns.Layout(tag, "10.213.0.0/24")
        prefix = f"ct-{tag}-"
        for ns in netns.list_namespaces():
            if ns.startswith(prefix) and ns[len(prefix):].isdigit():
                for p in netns.namespace_pids(ns):
                    try:
                        os.kill(p, 9)
                    except ProcessLookupError:
                        pass
                netns.delete_node(nl, int(ns[len(prefix):]))
        netns.delete_bridge(nl)


def _remove_tree(d: Path, patience: float = 3.0) -> None:
    """rmtree that outlasts a dying process still writing its last file (a job's exit code
    written as it is killed): try again until the folder is gone or ``patience`` runs out."""
    deadline = time.monotonic() + patience
    while d.exists():
        shutil.rmtree(d, ignore_errors=True)
        if not d.exists() or time.monotonic() > deadline:
            return
        time.sleep(0.05)
