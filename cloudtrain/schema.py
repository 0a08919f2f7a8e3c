"""The local state's tables: the SQL that creates them, the schema version, the columns added
since the first release, and the typed rows ``state`` reads from them.

Schema versions (``PRAGMA user_version``): 0/1 the first release; 2 adds ``usage.end_reason``
(why the interval closed: "terminated", "stopped", "budget: $X of $Y"),
``usage.cluster_created_at`` (tells a re-created cluster of the same name from the earlier one),
``usage.max_cost_usd``, ``clusters.max_cost_usd`` (the budget in force) and
``launches.end_reason``; 3 adds the ``recoveries`` table (one row per replacement of nodes
the cloud took, issue 13: when, which ranks, the cloud's reason, the seconds lost by phase,
the dollars); 4 adds ``recoveries.resumed_from`` (what the restarted job could resume from:
"restarted from step 0" when nothing, issue 21); 5 adds ``launches.image`` and
``launches.image_digest`` (issue 25: the task's container image and the digest every node ran,
``NAME@sha256:...`` from the registry or the local image ID); 6 adds ``launches.preflight``
(issue 27: the preflight's verdict, JSON). Older databases are migrated in place when
opened (``state``). The ``outputs`` table (issue 21: per job, the outputs its task declared,
where they go here, and whether they were pulled back or lost) is created when missing, like
every table: it needs no version; so are ``sweeps`` (issue 23: one row per sweep, the ledger's
entry for its spend) and ``sweep_trials`` (its per-trial rows: state, objective, times, GPUs,
cost), both written by the laptop each time it reads the sweep (``sweeps.finished``: that
reading was the sweep's end; ``sweeps.stopped``: why it stopped early). ``cluster_images``
(issue 25: the image and digest a cluster's nodes run, as the last pull or lookup found them,
which the next launch's row records; a NULL digest: a pull began and did not finish, so
``down`` still looks for images cloudtrain pulled) is created when missing too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    updated_at REAL NOT NULL,
    max_cost_usd REAL
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
    failed_node INTEGER,
    end_reason TEXT,
    image TEXT,
    image_digest TEXT,
    preflight TEXT
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
    ended_at REAL,
    end_reason TEXT,
    cluster_created_at REAL,
    max_cost_usd REAL
);
CREATE INDEX IF NOT EXISTS usage_cluster ON usage(cluster);
CREATE TABLE IF NOT EXISTS cluster_images (
    cluster TEXT PRIMARY KEY,
    image TEXT NOT NULL,
    digest TEXT,
    image_id TEXT,
    updated_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS launches_cluster ON launches(cluster);
CREATE TABLE IF NOT EXISTS job_envs (
    cluster TEXT PRIMARY KEY,
    envs_json TEXT NOT NULL DEFAULT '{}',
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS recoveries (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    cluster TEXT NOT NULL,
    launch_job TEXT NOT NULL,
    old_job TEXT NOT NULL,
    new_job TEXT,
    lost_at REAL NOT NULL,
    ranks TEXT NOT NULL,
    reason TEXT NOT NULL,
    detect_s REAL, replace_s REAL, bootstrap_s REAL, sync_s REAL, restart_s REAL,
    lost_work_usd REAL, replacement_usd REAL,
    status TEXT NOT NULL DEFAULT 'REPLACING',
    resumed_from TEXT
);
CREATE INDEX IF NOT EXISTS recoveries_cluster ON recoveries(cluster);
CREATE TABLE IF NOT EXISTS outputs (
    job_id TEXT PRIMARY KEY,
    cluster TEXT NOT NULL,
    paths_json TEXT NOT NULL,
    from_all INTEGER NOT NULL DEFAULT 0,
    dest TEXT NOT NULL,
    started_at REAL NOT NULL,
    pulled_at REAL,
    lost TEXT
);
CREATE INDEX IF NOT EXISTS outputs_cluster ON outputs(cluster);
CREATE TABLE IF NOT EXISTS sweeps (
    name TEXT PRIMARY KEY,
    cluster TEXT NOT NULL,
    spec_json TEXT NOT NULL,
    started_at REAL NOT NULL,
    hourly_price REAL,
    slots_per_node INTEGER NOT NULL DEFAULT 1,
    spent_usd REAL,
    updated_at REAL,
    finished INTEGER NOT NULL DEFAULT 0,
    stopped TEXT
);
CREATE TABLE IF NOT EXISTS sweep_trials (
    sweep TEXT NOT NULL,
    number INTEGER NOT NULL,
    state TEXT NOT NULL,
    value REAL,
    started_at REAL,
    ended_at REAL,
    gpus TEXT NOT NULL DEFAULT '',
    node TEXT,
    cost_usd REAL,
    params_json TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (sweep, number)
);
"""

SCHEMA_VERSION = 6

# Columns added after the first release: (table, column, declaration). A database created
# before them gets them through ALTER TABLE when it is opened.
ADDED_COLUMNS = (
    ("clusters", "max_cost_usd", "REAL"),
    ("launches", "end_reason", "TEXT"),
    ("usage", "end_reason", "TEXT"),
    ("usage", "cluster_created_at", "REAL"),
    ("usage", "max_cost_usd", "REAL"),
    ("recoveries", "resumed_from", "TEXT"),
    ("launches", "image", "TEXT"),
    ("launches", "image_digest", "TEXT"),
    ("launches", "preflight", "TEXT"),
)


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
    max_cost_usd: float | None = None


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
    end_reason: str | None = None
    image: str | None = None
    """The task's container image (None: the launch ran without a container)."""
    image_digest: str | None = None
    """The digest every node ran: ``NAME@sha256:...`` or the local image ID."""
    preflight: str | None = None
    """The preflight that guarded the launch (JSON: ok, paragraph, ...); None: none ran."""


@dataclass
class RecoveryRow:
    """One replacement of lost nodes (``launch_job``: the launch it belongs to; ``old_job`` the
    job that lost them, ``new_job`` the one restarted). Seconds from the loss (as the cloud
    reported it) to training again: detect, replace (provision), bootstrap, sync, restart."""

    id: int
    cluster: str
    launch_job: str
    old_job: str
    new_job: str | None
    lost_at: float
    ranks: list[int]
    reason: str
    detect_s: float | None = None
    replace_s: float | None = None
    bootstrap_s: float | None = None
    sync_s: float | None = None
    restart_s: float | None = None
    lost_work_usd: float | None = None
    replacement_usd: float | None = None
    status: str = "REPLACING"
    resumed_from: str | None = None

    @property
    def seconds_lost(self) -> float:
        return sum(x or 0.0 for x in (self.detect_s, self.replace_s, self.bootstrap_s,
                                      self.sync_s, self.restart_s))


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
    end_reason: str | None = None
    cluster_created_at: float | None = None
    """The cluster's creation time: intervals of one cluster share it (a stop and start keeps
    it; a cluster taken down and created again under the same name gets a new one)."""
    max_cost_usd: float | None = None


@dataclass
class OutputsRow:
    """A job's declared outputs: ``paths`` inside its workdir, from the head node or every
    node (``from_all``, then into ``dest/node-N``), pulled into ``dest``. ``pulled_at``: when
    they were last pulled after the job ended (None: never); ``lost``: why they never will be
    (the cluster went down without them)."""

    job_id: str
    cluster: str
    paths: list[str]
    from_all: bool
    dest: str
    started_at: float
    pulled_at: float | None = None
    lost: str | None = None


@dataclass(frozen=True)
class SweepRow:
    """A sweep started from this machine (``cloudtrain sweep``): its cluster, its validated
    spec (as JSON), the node's price and GPU slots when it started, and what it had cost when
    last read (``spent_usd``, at ``updated_at``)."""

    name: str
    cluster: str
    spec: dict[str, Any]
    started_at: float
    hourly_price: float | None
    slots_per_node: int
    spent_usd: float | None = None
    updated_at: float | None = None
    finished: bool = False
    """The last reading was the sweep's end (every trial ended, or it was stopped)."""
    stopped: str | None = None
    """Why the sweep stopped early (the driver's words), when it did."""


@dataclass(frozen=True)
class SweepEnd:
    """What one reading of a sweep says of its end: ``finished`` (the sweep's end: every trial
    ended, or it was stopped), ``stopped`` (why it stopped early), ``as_of`` (when the head
    wrote it; None: now)."""

    finished: bool = False
    stopped: str | None = None
    as_of: float | None = None


@dataclass(frozen=True)
class SweepTrialRow:
    """One trial of a sweep in the ledger: its state and objective, when it ran, the GPUs it
    held on which node, and its cost (its GPUs' share of the node's price for its duration)."""

    sweep: str
    number: int
    state: str
    value: float | None
    started_at: float | None
    ended_at: float | None
    gpus: str
    node: str | None
    cost_usd: float | None
    params: dict[str, Any] = field(default_factory=dict)
