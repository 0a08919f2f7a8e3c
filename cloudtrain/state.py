"""Local state: a cache of what the providers said, and a ledger of what was spent.

SQLite in WAL mode with a busy timeout, every write in its own short ``BEGIN IMMEDIATE``
transaction, so several ``cloudtrain`` processes can share it. The provider stays the truth
about what exists; these rows are what we last saw, plus history (launches, usage).

The usage ledger: one row per interval during which a cluster's nodes existed (created ->
terminated, or started -> stopped), with the hourly price per node in force when the interval
opened. Rows outlive the cluster (``down`` deletes the cluster and its nodes, never usage), and
a price is never rewritten afterwards: costs come from these rows alone (see ledger.py).

The tables, their versions and the row types are in ``schema`` (imported from there);
older databases are migrated in place when opened.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Protocol

from cloudtrain.schema import (ADDED_COLUMNS, SCHEMA, SCHEMA_VERSION, ClusterRow, LaunchRow,
                               NodeRow, OutputsRow, RecoveryRow, SweepEnd, SweepRow, SweepTrialRow,
                               UsageRow)


class HasImage(Protocol):
    """What add_launch reads of a task's ``container:`` (containers.spec.ContainerSpec)."""

    @property
    def image(self) -> str: ...


class State:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        # Private before sqlite first opens it (its -wal/-shm files take the database's mode).
        os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
        for f in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
            if f.exists() and f.stat().st_mode & 0o077:
                f.chmod(0o600)
        db = self._connect()
        try:
            db.executescript(SCHEMA)
        finally:
            db.close()
        self._migrate()

    def _migrate(self) -> None:
        """Bring a database written by an older cloudtrain to SCHEMA_VERSION (idempotent, and
        safe when several processes open the same old database at once)."""
        with self._read() as db:
            if db.execute("PRAGMA user_version").fetchone()[0] >= SCHEMA_VERSION:
                return
        with self._write() as db:
            if db.execute("PRAGMA user_version").fetchone()[0] >= SCHEMA_VERSION:
                return
            for table, column, decl in ADDED_COLUMNS:
                have = {r["name"] for r in db.execute(f"PRAGMA table_info({table})")}
                if column not in have:
                    db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")
            # Before end_reason existed, an interval closed only when its cluster went down.
            db.execute("UPDATE usage SET end_reason='terminated' "
                       "WHERE ended_at IS NOT NULL AND end_reason IS NULL")
            # Intervals of a cluster that still exists, opened since it was created, are its own;
            # older ones (an earlier cluster of the same name) stay apart (NULL).
            db.execute("""UPDATE usage SET cluster_created_at=(
                              SELECT c.created_at FROM clusters c WHERE c.name=usage.cluster)
                          WHERE cluster_created_at IS NULL AND EXISTS (
                              SELECT 1 FROM clusters c WHERE c.name=usage.cluster
                              AND usage.started_at >= c.created_at)""")
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA busy_timeout=30000")
        # Switching a new database to WAL can answer "locked" at once, without waiting on the
        # busy timeout, while other processes open it too: try again for a while.
        deadline = time.monotonic() + 30
        while True:
            try:
                db.execute("PRAGMA journal_mode=WAL")
                break
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    db.close()
                    raise
                time.sleep(0.02)
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
        from cloudtrain.names import check

        check(row.name)  # defense in depth: no record under a name the CLI would refuse
        now = time.time()
        with self._write() as db:
            db.execute(
                """INSERT INTO clusters (name, provider, status, num_nodes, region, zone,
                   instance_type, accelerators, use_spot, hourly_price, master_port, options_json,
                   resources_json, created_at, updated_at, max_cost_usd)
                   VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)
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
                 row.created_at or now, now, row.max_cost_usd),
            )
        # (max_cost_usd is left alone on update: only set_budget changes a cluster's budget.)

    def set_budget(self, name: str, max_cost_usd: float | None) -> None:
        """The budget in force for the cluster (and its open usage interval)."""
        with self._write() as db:
            db.execute("UPDATE clusters SET max_cost_usd=?, updated_at=? WHERE name=?",
                       (max_cost_usd, time.time(), name))
            db.execute("UPDATE usage SET max_cost_usd=? WHERE cluster=? AND ended_at IS NULL",
                       (max_cost_usd, name))

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
        from cloudtrain.names import check

        check(name)
        with self._write() as db:
            db.execute("DELETE FROM nodes WHERE cluster=?", (name,))
            db.execute("DELETE FROM clusters WHERE name=?", (name,))
            db.execute("DELETE FROM job_envs WHERE cluster=?", (name,))
            db.execute("DELETE FROM cluster_images WHERE cluster=?", (name,))

    # --- the environment of the cluster's last launch (for exec) -----------------------------

    def set_job_envs(self, cluster: str, envs: dict[str, str]) -> None:
        with self._write() as db:
            db.execute("INSERT OR REPLACE INTO job_envs (cluster, envs_json, updated_at) "
                       "VALUES (?, ?, ?)", (cluster, json.dumps(envs), time.time()))

    def job_envs(self, cluster: str) -> dict[str, str]:
        with self._read() as db:
            r = db.execute("SELECT envs_json FROM job_envs WHERE cluster=?", (cluster,)).fetchone()
        return {} if r is None else {str(k): str(v) for k, v in json.loads(r[0]).items()}

    @staticmethod
    def _cluster_from(r: sqlite3.Row) -> ClusterRow:
        return ClusterRow(
            name=r["name"], provider=r["provider"], status=r["status"], num_nodes=r["num_nodes"],
            created_at=r["created_at"], updated_at=r["updated_at"], region=r["region"],
            zone=r["zone"], instance_type=r["instance_type"], accelerators=r["accelerators"],
            use_spot=bool(r["use_spot"]), hourly_price=r["hourly_price"],
            master_port=r["master_port"], options=json.loads(r["options_json"]),
            resources=json.loads(r["resources_json"]), max_cost_usd=r["max_cost_usd"],
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

    def add_launch(self, cluster: str, job_id: str, task_name: str | None, detached: bool,
                   container: HasImage | None = None) -> int:
        """A launch's row. ``container``: the task's (issue 25): the row records its image
        and the digest the cluster's nodes run it as (set_cluster_image, by the pull)."""
        image = None if container is None else container.image
        with self._write() as db:
            seen = None if image is None else db.execute(
                "SELECT digest FROM cluster_images WHERE cluster=? AND image=?",
                (cluster, image)).fetchone()
            cur = db.execute(
                "INSERT INTO launches (cluster, job_id, task_name, status, detached, started_at, "
                "image, image_digest) VALUES (?,?,?,?,?,?,?,?)",
                (cluster, job_id, task_name, "RUNNING", int(detached), time.time(), image,
                 None if seen is None else seen["digest"]),
            )
            return int(cur.lastrowid or 0)

    def finish_launch(self, job_id: str, status: str, exit_code: int | None,
                      failed_node: int | None, reason: str | None = None) -> None:
        with self._write() as db:
            db.execute(
                "UPDATE launches SET status=?, exit_code=?, failed_node=?, ended_at=?, "
                "end_reason=? WHERE job_id=?",
                (status, exit_code, failed_node, time.time(), reason, job_id),
            )

    def set_launch_preflight(self, job_id: str, verdict_json: str) -> None:
        with self._write() as db:
            db.execute("UPDATE launches SET preflight=? WHERE job_id=?", (verdict_json, job_id))

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
                              failed_node=r["failed_node"], end_reason=r["end_reason"],
                              image=r["image"], image_digest=r["image_digest"],
                              preflight=r["preflight"])
                    for r in rows]

    # --- the image a cluster's nodes run (containers) ---------------------------------------

    def set_cluster_image(self, cluster: str, image: str, digest: str | None = None,
                          image_id: str | None = None) -> None:
        """What the cluster's nodes run (no digest: a pull began, not finished yet)."""
        with self._write() as db:
            db.execute("INSERT OR REPLACE INTO cluster_images (cluster, image, digest, image_id, "
                       "updated_at) VALUES (?,?,?,?,?)",
                       (cluster, image, digest, image_id, time.time()))

    def cluster_image(self, cluster: str) -> tuple[str, str | None, str | None] | None:
        """(image, digest, image ID) as the cluster's last pull or lookup found them."""
        with self._read() as db:
            r = db.execute("SELECT image, digest, image_id FROM cluster_images WHERE cluster=?",
                           (cluster,)).fetchone()
        return None if r is None else (r["image"], r["digest"], r["image_id"])

    # --- each job's outputs (issue 21) ---------------------------------------------------------

    def add_outputs(self, row: OutputsRow) -> None:
        with self._write() as db:
            db.execute("INSERT OR REPLACE INTO outputs (job_id, cluster, paths_json, from_all, "
                       "dest, started_at) VALUES (?,?,?,?,?,?)",
                       (row.job_id, row.cluster, json.dumps(row.paths), int(row.from_all),
                        row.dest, row.started_at))

    def mark_outputs(self, job_ids: list[str], *, pulled: bool = False,
                     lost: str | None = None) -> None:
        """Record that the jobs' outputs were pulled now, or why they never will be."""
        with self._write() as db:
            for job_id in job_ids:
                if pulled:
                    db.execute("UPDATE outputs SET pulled_at=?, lost=NULL WHERE job_id=?",
                               (time.time(), job_id))
                else:
                    db.execute("UPDATE outputs SET lost=? WHERE job_id=?", (lost, job_id))

    # --- sweeps (issue 23): one entry per sweep, its per-trial rows ----------------------------

    def add_sweep(self, row: SweepRow) -> None:
        with self._write() as db:
            db.execute("INSERT OR REPLACE INTO sweeps (name, cluster, spec_json, started_at, "
                       "hourly_price, slots_per_node) VALUES (?,?,?,?,?,?)",
                       (row.name, row.cluster, json.dumps(row.spec), row.started_at,
                        row.hourly_price, row.slots_per_node))
            db.execute("DELETE FROM sweep_trials WHERE sweep=?", (row.name,))

    def get_sweep(self, name: str) -> SweepRow | None:
        with self._read() as db:
            r = db.execute("SELECT * FROM sweeps WHERE name=?", (name,)).fetchone()
        return None if r is None else SweepRow(
            r["name"], r["cluster"], dict(json.loads(r["spec_json"])), r["started_at"],
            r["hourly_price"], r["slots_per_node"], r["spent_usd"], r["updated_at"],
            bool(r["finished"]), r["stopped"])

    def sweeps(self) -> list[SweepRow]:
        """Every sweep started from this machine, oldest first."""
        with self._read() as db:
            names = [r["name"] for r in db.execute("SELECT name FROM sweeps ORDER BY started_at")]
        return [row for row in (self.get_sweep(n) for n in names) if row is not None]

    def set_sweep_trials(self, name: str, spent_usd: float | None,
                         trials: list[SweepTrialRow], end: SweepEnd | None = None) -> None:
        """The sweep's spend and its trials as last read from the head (``end``: whether that
        reading was the sweep's end, why it stopped, and when the head wrote it)."""
        end = end or SweepEnd()
        with self._write() as db:
            db.execute("UPDATE sweeps SET spent_usd=?, updated_at=?, finished=?, stopped=? "
                       "WHERE name=?", (spent_usd, end.as_of or time.time(), int(end.finished),
                                        end.stopped, name))
            db.executemany("INSERT OR REPLACE INTO sweep_trials VALUES (?,?,?,?,?,?,?,?,?,?)",
                           [(t.sweep, t.number, t.state, t.value, t.started_at, t.ended_at,
                             t.gpus, t.node, t.cost_usd, json.dumps(t.params))
                            for t in trials])

    def sweep_trials(self, name: str) -> list[SweepTrialRow]:
        with self._read() as db:
            rows = db.execute("SELECT * FROM sweep_trials WHERE sweep=? ORDER BY number",
                              (name,)).fetchall()
        return [SweepTrialRow(r["sweep"], r["number"], r["state"], r["value"], r["started_at"],
                              r["ended_at"], r["gpus"], r["node"], r["cost_usd"],
                              dict(json.loads(r["params_json"]))) for r in rows]

    def outputs(self, cluster: str) -> list[OutputsRow]:
        """The cluster's jobs that declared outputs, oldest first."""
        with self._read() as db:
            rows = db.execute("SELECT * FROM outputs WHERE cluster=? ORDER BY started_at, job_id",
                              (cluster,)).fetchall()
        return [OutputsRow(job_id=r["job_id"], cluster=r["cluster"],
                           paths=[str(p) for p in json.loads(r["paths_json"])],
                           from_all=bool(r["from_all"]), dest=r["dest"],
                           started_at=r["started_at"], pulled_at=r["pulled_at"], lost=r["lost"])
                for r in rows]

    # --- recoveries (issue 13) --------------------------------------------------------------

    def add_recovery(self, cluster: str, launch_job: str, old_job: str, lost_at: float,
                     ranks: list[int], reason: str, resumed_from: str | None = None) -> int:
        with self._write() as db:
            cur = db.execute(
                "INSERT INTO recoveries (cluster, launch_job, old_job, lost_at, ranks, reason, "
                "resumed_from) VALUES (?,?,?,?,?,?,?)",
                (cluster, launch_job, old_job, lost_at, ",".join(map(str, ranks)), reason,
                 resumed_from))
            return int(cur.lastrowid or 0)

    def update_recovery(self, rid: int, **fields: object) -> None:
        allowed = {"new_job", "detect_s", "replace_s", "bootstrap_s", "sync_s", "restart_s",
                   "lost_work_usd", "replacement_usd", "status"}
        bad = set(fields) - allowed
        if bad:
            raise ValueError(f"not recovery fields: {sorted(bad)}")
        if fields:
            with self._write() as db:
                db.execute(f"UPDATE recoveries SET {', '.join(f'{k}=?' for k in fields)} "
                           "WHERE id=?", (*fields.values(), rid))

    def recoveries(self, cluster: str | None = None) -> list[RecoveryRow]:
        sql, args = "SELECT * FROM recoveries", tuple[str, ...]()
        if cluster is not None:
            sql, args = sql + " WHERE cluster=?", (cluster,)
        with self._read() as db:
            rows = db.execute(sql + " ORDER BY id", args).fetchall()
        return [RecoveryRow(**{k: r[k] for k in r.keys() if k != "ranks"},
                            ranks=[int(x) for x in r["ranks"].split(",") if x]) for r in rows]

    # --- usage ledger ----------------------------------------------------------------------

    def open_usage(self, c: ClusterRow, when: float | None = None) -> None:
        """Start a usage interval unless one is open already (an adopted cluster). Called when
        a cluster's nodes are created, and again when a stopped cluster is started: the new
        interval records the price in force now (``c.hourly_price``)."""
        with self._write() as db:
            r = db.execute("SELECT id FROM usage WHERE cluster=? AND ended_at IS NULL",
                           (c.name,)).fetchone()
            if r is not None:
                return
            db.execute(
                """INSERT INTO usage (cluster, provider, region, zone, instance_type, accelerators,
                   num_nodes, use_spot, hourly_price_per_node, started_at, cluster_created_at,
                   max_cost_usd)
                   VALUES (?,?,?,?,?,?,?,?,?,?,?,
                           COALESCE(?, (SELECT max_cost_usd FROM clusters WHERE name=?)))""",
                (c.name, c.provider, c.region, c.zone, c.instance_type, c.accelerators,
                 c.num_nodes, int(c.use_spot), c.hourly_price, when or time.time(),
                 c.created_at or None, c.max_cost_usd, c.name),
            )

    def close_usage(self, cluster: str, when: float | None = None,
                    reason: str = "terminated") -> None:
        """End the cluster's open interval: ``reason`` "terminated" (down, rollback) or
        "stopped" (nodes stopped, not billed until started again). A reason marked beforehand
        with :meth:`mark_usage_end` (e.g. the budget) wins."""
        with self._write() as db:
            db.execute("UPDATE usage SET ended_at=?, end_reason=COALESCE(end_reason, ?) "
                       "WHERE cluster=? AND ended_at IS NULL",
                       (when or time.time(), reason, cluster))

    def mark_usage_end(self, cluster: str, reason: str) -> None:
        """Say why the open interval is about to end (before the teardown that ends it, so the
        reason is not lost when the teardown is the last thing this process does)."""
        with self._write() as db:
            db.execute("UPDATE usage SET end_reason=? WHERE cluster=? AND ended_at IS NULL",
                       (reason, cluster))

    def usage(self, cluster: str | None = None, since: float | None = None) -> list[UsageRow]:
        """Usage intervals in the order they were opened; ``cluster``: only that name's;
        ``since``: only those still open or ended at or after that time."""
        sql = "SELECT * FROM usage WHERE 1=1"
        args: list[object] = []
        if cluster is not None:
            sql += " AND cluster=?"
            args.append(cluster)
        if since is not None:
            sql += " AND (ended_at IS NULL OR ended_at >= ?)"
            args.append(since)
        with self._read() as db:
            return [UsageRow(id=r["id"], cluster=r["cluster"], provider=r["provider"],
                             region=r["region"], zone=r["zone"], instance_type=r["instance_type"],
                             accelerators=r["accelerators"], num_nodes=r["num_nodes"],
                             use_spot=bool(r["use_spot"]),
                             hourly_price_per_node=r["hourly_price_per_node"],
                             started_at=r["started_at"], ended_at=r["ended_at"],
                             end_reason=r["end_reason"], cluster_created_at=r["cluster_created_at"],
                             max_cost_usd=r["max_cost_usd"])
                    for r in db.execute(sql + " ORDER BY id", args)]


def open_state(home: Path) -> State:
    return State(home / "state.db")
