"""Local state: a cache of what the providers said, and a ledger of what was spent.

SQLite in WAL mode with a busy timeout, every write in its own short ``BEGIN IMMEDIATE``
transaction, so several ``cloudtrain`` processes can share it. The provider stays the truth
about what exists; these rows are what we last saw, plus history (launches, usage).
"""

from __future__ import annotations

import json
import sqlite3
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

SCHEMA = """
CREATE TABLE IF NOT EXISTS clusters (
    name TEXT PRIMARY KEY,
    provider TEXT NOT NULL,
    status TEXT NOT NULL,
    num_nodes INTEGER NOT NULL,
    region TEXT, zone TEXT, instance_type TEXT, accelerators TEXT,
    use_spot INTEGER NOT NULL DEFAULT 0,
    hourly_price REAL,
    master_port INTEGER NOT NULL DEFAULT 29500,
    options_json TEXT NOT NULL DEFAULT '{}',
    resources_json TEXT NOT NULL DEFAULT '{}',
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS nodes (
    cluster TEXT NOT NULL,
    rank INTEGER NOT NULL,
    instance_id TEXT NOT NULL,
    host TEXT NOT NULL,
    port INTEGER NOT NULL,
    user TEXT NOT NULL,
    internal_ip TEXT NOT NULL,
    status TEXT NOT NULL,
    root_dir TEXT NOT NULL,
    identity_file TEXT,
    iface TEXT,
    python_bin TEXT,
    gpus INTEGER,
    bootstrap_version TEXT,
    bootstrap_json TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (cluster, rank)
);
CREATE TABLE IF NOT EXISTS launches (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    cluster TEXT NOT NULL,
    job_id TEXT NOT NULL UNIQUE,
    task_name TEXT,
    status TEXT NOT NULL,
    detached INTEGER NOT NULL DEFAULT 0,
    started_at REAL NOT NULL,
    ended_at REAL,
    exit_code INTEGER,
    failed_node INTEGER
);
CREATE TABLE IF NOT EXISTS usage (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    cluster TEXT NOT NULL,
    provider TEXT NOT NULL,
    region TEXT, zone TEXT, instance_type TEXT, accelerators TEXT,
    num_nodes INTEGER NOT NULL,
    use_spot INTEGER NOT NULL DEFAULT 0,
    hourly_price_per_node REAL,
    started_at REAL NOT NULL,
    ended_at REAL
);
CREATE INDEX IF NOT EXISTS usage_cluster ON usage(cluster);
CREATE INDEX IF NOT EXISTS launches_cluster ON launches(cluster);
"""


@dataclass
class NodeRow:
    cluster: str
    rank: int
    instance_id: str
    host: str
    port: int
    user: str
    internal_ip: str
    status: str
    root_dir: str
    identity_file: str | None = None
    iface: str | None = None
    python_bin: str | None = None
    gpus: int | None = None
    bootstrap_version: str | None = None
    bootstrap: dict[str, str] = field(default_factory=dict)


@dataclass
class ClusterRow:
    name: str
    provider: str
    status: str
    num_nodes: int
    created_at: float
    updated_at: float
    region: str | None = None
    zone: str | None = None
    instance_type: str | None = None
    accelerators: str | None = None
    use_spot: bool = False
    hourly_price: float | None = None
    master_port: int = 29500
    options: dict[str, object] = field(default_factory=dict)
    resources: dict[str, object] = field(default_factory=dict)
    nodes: list[NodeRow] = field(default_factory=list)


@dataclass
class LaunchRow:
    id: int
    cluster: str
    job_id: str
    task_name: str | None
    status: str
    detached: bool
    started_at: float
    ended_at: float | None
    exit_code: int | None
    failed_node: int | None


@dataclass
class UsageRow:
    id: int
    cluster: str
    provider: str
    region: str | None
    zone: str | None
    instance_type: str | None
    accelerators: str | None
    num_nodes: int
    use_spot: bool
    hourly_price_per_node: float | None
    started_at: float
    ended_at: float | None


class State:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            db.executescript(SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA busy_timeout=30000")
        db.execute("PRAGMA foreign_keys=ON")
        return db

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        db = self._connect()
        try:
            db.execute("BEGIN IMMEDIATE")
            yield db
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        finally:
            db.close()

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        db = self._connect()
        try:
            yield db
        finally:
            db.close()

    # --- clusters --------------------------------------------------------------------------

    def upsert_cluster(self, row: ClusterRow) -> None:
        now = time.time()
        with self._write() as db:
            db.execute(
                """INSERT INTO clusters (name, provider, status, num_nodes, region, zone,
                   instance_type, accelerators, use_spot, hourly_price, master_port, options_json,
                   resources_json, created_at, updated_at)
                   VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)
                   ON CONFLICT(name) DO UPDATE SET provider=excluded.provider,
                   status=excluded.status, num_nodes=excluded.num_nodes, region=excluded.region,
                   zone=excluded.zone, instance_type=excluded.instance_type,
                   accelerators=excluded.accelerators, use_spot=excluded.use_spot,
                   hourly_price=excluded.hourly_price, master_port=excluded.master_port,
                   options_json=excluded.options_json, resources_json=excluded.resources_json,
                   updated_at=excluded.updated_at""",
                (row.name, row.provider, row.status, row.num_nodes, row.region, row.zone,
                 row.instance_type, row.accelerators, int(row.use_spot), row.hourly_price,
                 row.master_port, json.dumps(row.options), json.dumps(row.resources),
                 row.created_at or now, now),
            )

    def set_cluster_status(self, name: str, status: str) -> None:
        with self._write() as db:
            db.execute("UPDATE clusters SET status=?, updated_at=? WHERE name=?",
                       (status, time.time(), name))

    def get_cluster(self, name: str) -> ClusterRow | None:
        with self._read() as db:
            r = db.execute("SELECT * FROM clusters WHERE name=?", (name,)).fetchone()
            if r is None:
                return None
            row = self._cluster_from(r)
            row.nodes = self._nodes(db, name)
            return row

    def list_clusters(self) -> list[ClusterRow]:
        with self._read() as db:
            rows = [self._cluster_from(r) for r in
                    db.execute("SELECT * FROM clusters ORDER BY created_at, name")]
            for row in rows:
                row.nodes = self._nodes(db, row.name)
            return rows

    def delete_cluster(self, name: str) -> None:
        with self._write() as db:
            db.execute("DELETE FROM nodes WHERE cluster=?", (name,))
            db.execute("DELETE FROM clusters WHERE name=?", (name,))

    @staticmethod
    def _cluster_from(r: sqlite3.Row) -> ClusterRow:
        return ClusterRow(
            name=r["name"], provider=r["provider"], status=r["status"], num_nodes=r["num_nodes"],
            created_at=r["created_at"], updated_at=r["updated_at"], region=r["region"],
            zone=r["zone"], instance_type=r["instance_type"], accelerators=r["accelerators"],
            use_spot=bool(r["use_spot"]), hourly_price=r["hourly_price"],
            master_port=r["master_port"], options=json.loads(r["options_json"]),
            resources=json.loads(r["resources_json"]),
        )

    # --- nodes -----------------------------------------------------------------------------

    @staticmethod
    def _nodes(db: sqlite3.Connection, cluster: str) -> list[NodeRow]:
        out = []
        for r in db.execute("SELECT * FROM nodes WHERE cluster=? ORDER BY rank", (cluster,)):
            out.append(NodeRow(
                cluster=r["cluster"], rank=r["rank"], instance_id=r["instance_id"], host=r["host"],
                port=r["port"], user=r["user"], internal_ip=r["internal_ip"], status=r["status"],
                root_dir=r["root_dir"], identity_file=r["identity_file"], iface=r["iface"],
                python_bin=r["python_bin"], gpus=r["gpus"],
                bootstrap_version=r["bootstrap_version"],
                bootstrap=json.loads(r["bootstrap_json"]),
            ))
        return out

    def replace_nodes(self, cluster: str, nodes: list[NodeRow]) -> None:
        """Store what the provider reported, keeping what bootstrap learned about a node that
        is still the same instance."""
        with self._write() as db:
            old = {n.rank: n for n in self._nodes(db, cluster)}
            db.execute("DELETE FROM nodes WHERE cluster=?", (cluster,))
            for n in nodes:
                prev = old.get(n.rank)
                if prev is not None and prev.instance_id == n.instance_id:
                    n.iface = n.iface or prev.iface
                    n.python_bin = n.python_bin or prev.python_bin
                    n.gpus = n.gpus if n.gpus is not None else prev.gpus
                    n.bootstrap_version = n.bootstrap_version or prev.bootstrap_version
                    n.bootstrap = n.bootstrap or prev.bootstrap
                db.execute(
                    """INSERT INTO nodes (cluster, rank, instance_id, host, port, user, internal_ip,
                       status, root_dir, identity_file, iface, python_bin, gpus,
                       bootstrap_version, bootstrap_json) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)""",
                    (cluster, n.rank, n.instance_id, n.host, n.port, n.user, n.internal_ip,
                     n.status, n.root_dir, n.identity_file, n.iface, n.python_bin, n.gpus,
                     n.bootstrap_version, json.dumps(n.bootstrap)),
                )

    def set_node_bootstrap(self, cluster: str, rank: int, *, version: str, iface: str | None,
                           python_bin: str | None, gpus: int | None, info: dict[str, str]) -> None:
        with self._write() as db:
            db.execute(
                """UPDATE nodes SET bootstrap_version=?, iface=?, python_bin=?, gpus=?,
                   bootstrap_json=? WHERE cluster=? AND rank=?""",
                (version, iface, python_bin, gpus, json.dumps(info), cluster, rank),
            )

    # --- launches --------------------------------------------------------------------------

    def add_launch(self, cluster: str, job_id: str, task_name: str | None, detached: bool) -> int:
        with self._write() as db:
            cur = db.execute(
                "INSERT INTO launches (cluster, job_id, task_name, status, detached, started_at) "
                "VALUES (?,?,?,?,?,?)",
                (cluster, job_id, task_name, "RUNNING", int(detached), time.time()),
            )
            return int(cur.lastrowid or 0)

    def finish_launch(self, job_id: str, status: str, exit_code: int | None,
                      failed_node: int | None) -> None:
        with self._write() as db:
            db.execute(
                "UPDATE launches SET status=?, exit_code=?, failed_node=?, ended_at=? WHERE job_id=?",
                (status, exit_code, failed_node, time.time(), job_id),
            )

    def launches(self, cluster: str | None = None) -> list[LaunchRow]:
        with self._read() as db:
            if cluster is None:
                rows = db.execute("SELECT * FROM launches ORDER BY id").fetchall()
            else:
                rows = db.execute("SELECT * FROM launches WHERE cluster=? ORDER BY id",
                                  (cluster,)).fetchall()
            return [LaunchRow(id=r["id"], cluster=r["cluster"], job_id=r["job_id"],
                              task_name=r["task_name"], status=r["status"],
                              detached=bool(r["detached"]), started_at=r["started_at"],
                              ended_at=r["ended_at"], exit_code=r["exit_code"],
                              failed_node=r["failed_node"]) for r in rows]

    # --- usage ledger ----------------------------------------------------------------------

    def open_usage(self, c: ClusterRow) -> None:
        """Start a usage interval unless one is open already (an adopted cluster)."""
        with self._write() as db:
            r = db.execute("SELECT id FROM usage WHERE cluster=? AND ended_at IS NULL",
                           (c.name,)).fetchone()
            if r is not None:
                return
            db.execute(
                """INSERT INTO usage (cluster, provider, region, zone, instance_type, accelerators,
                   num_nodes, use_spot, hourly_price_per_node, started_at)
                   VALUES (?,?,?,?,?,?,?,?,?,?)""",
                (c.name, c.provider, c.region, c.zone, c.instance_type, c.accelerators,
                 c.num_nodes, int(c.use_spot), c.hourly_price, time.time()),
            )

    def close_usage(self, cluster: str, when: float | None = None) -> None:
        with self._write() as db:
            db.execute("UPDATE usage SET ended_at=? WHERE cluster=? AND ended_at IS NULL",
                       (when or time.time(), cluster))

    def usage(self) -> list[UsageRow]:
        with self._read() as db:
            return [UsageRow(id=r["id"], cluster=r["cluster"], provider=r["provider"],
                             region=r["region"], zone=r["zone"], instance_type=r["instance_type"],
                             accelerators=r["accelerators"], num_nodes=r["num_nodes"],
                             use_spot=bool(r["use_spot"]),
                             hourly_price_per_node=r["hourly_price_per_node"],
                             started_at=r["started_at"], ended_at=r["ended_at"])
                    for r in db.execute("SELECT * FROM usage ORDER BY id")]


def open_state(home: Path) -> State:
    return State(home / "state.db")
