"""The provider contract: the one small typed door every provider comes through.

A provider is a class registered in the entry-point group ``cloudtrain.providers``. The
built-in ones (``local``, ``ssh``, and the clouds) are registered exactly like a third-party
plugin would be, in ``pyproject.toml``. cloudtrain constructs it as ``cls(ctx)``; cloud
providers take their SDK clients as further keyword arguments (defaulting to a factory), so
tests pass fakes in without patching module globals.

Writing one: import from :mod:`cloudtrain.provider` (this contract, the marks, host keys, the
catalog, and for a cloud the shared base :class:`cloudtrain.provider.cloud.CloudProvider`,
which brings the failover loop over the request's targets and attempt records) and
:mod:`cloudtrain.errors`
(raise CapacityError / QuotaError / AuthError / TransientError with ``code=``), nothing
else of cloudtrain. Implement the class attributes and the six verbs below; add any of the
optional capabilities at the end of this module (``master_port``, ``node_env``,
``attempts``, ``orphans``/``remove`` for gc, ...) by simply having the method: cloudtrain
checks for them with ``isinstance(provider, HasMasterPort)`` and so on.

Promises each method makes:

``check(request)``
    Returns fast, creates nothing. Raises :class:`~cloudtrain.errors.UserError` when the
    request cannot be satisfied by this provider (impossible shape, missing file, ...).
``plan(request)``
    Returns fast, creates nothing: what ``up`` would create, and what it would cost.
``ensure_network(request)``
    Idempotent. Creates (or adopts) the cluster's network boundary: SSH only from the
    caller's range, all traffic between the cluster's own nodes, declared ports only.
``create_nodes(request, network)``
    Idempotent. Reconciles by the cluster's tag: creates what is missing, adopts what exists,
    never double-creates. Returns when every node is running (SSH may still be starting).
    Raises CapacityError / QuotaError / AuthError / TransientError so a caller can fail over.
``list_nodes(cluster)``
    The truth, from the provider (the cloud's API, or the local daemons), in rank order.
``terminate(cluster)``
    Removes every resource carrying the cluster's tag and returns only when the provider
    confirms they are gone. Safe to call twice, with no local state, on a half-built cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import (TYPE_CHECKING, Any, Callable, ClassVar, Literal, Mapping, Protocol,
                    runtime_checkable)

if TYPE_CHECKING:
    from pydantic import BaseModel

    from cloudtrain.catalog.model import Offer
    from cloudtrain.taskmodel import Resources
    from cloudtrain.storage.url import BucketURL

NodeStatus = Literal["pending", "running", "stopped", "terminated", "unknown"]


@dataclass(frozen=True)
class Node:
    """One machine of a cluster, as the provider sees it."""

    rank: int
    instance_id: str
    host: str
    """The address cloudtrain's SSH connects to."""
    port: int = 22
    user: str = "root"
    internal_ip: str = ""
    """The address the other nodes reach this one at (MASTER_ADDR for the head)."""
    status: NodeStatus = "running"
    host_keys: tuple[str, ...] = ()
    """Host public keys known without contacting the node ("ssh-ed25519 AAAA..."). When
    given, they are pinned as-is; when empty, the key is learned on first contact."""
    root_dir: str = "cloudtrain"
    """Where cloudtrain keeps its files on the node; a relative path is under the login's $HOME."""
    identity_file: str | None = None
    """A private key of the user's (ssh provider); None: the cluster's own key."""
    spot: bool = False

    @property
    def cluster_ip(self) -> str:
        return self.internal_ip or self.host


@dataclass(frozen=True)
class Target:
    """One place to launch a cluster, decided by the plan (``pipeline/place.py``): the
    provider, the region, the zones the catalog lists there (tried in turn; () : the cloud
    asks for them), the instance type, its price per node-hour (None: the catalog has none),
    and the GPUs the cloud attaches to the machine separately (GCP's N1: the model and the
    count; None and 0 where the machine comes with its GPUs)."""

    provider: str
    region: str
    instance_type: str
    price: float | None
    zones: tuple[str, ...] = ()
    accelerator: str | None = None
    accelerator_count: int = 0


@dataclass(frozen=True)
class ClusterRequest:
    """What ``up`` asks a provider for."""

    name: str
    num_nodes: int
    resources: Resources
    options: BaseModel | None
    public_key: str
    """The cluster's SSH public key (OpenSSH format), to be authorised on every node."""
    max_hours: float | None = None
    """The task's hard lifetime (``max_hours``), for clouds that can enforce it natively."""
    buckets: tuple[BucketURL, ...] = ()
    """Buckets the nodes read and write (bucket file_mounts, ``checkpoints:``). A cloud gives
    its nodes an identity the cloud mints (instance profile / service account / managed
    identity) allowed on exactly these, never the user's own keys; see docs/storage.md."""
    targets: tuple[Target, ...] = ()
    """Where to launch, in the plan's order (ranked once, by ``pipeline/place.py``): a cloud
    tries them in turn (each one's zones in turn) and never ranks offers itself. Empty for
    providers that place nothing (local, ssh)."""


@dataclass(frozen=True)
class NetworkRef:
    provider_id: str = ""
    description: str = ""


@dataclass(frozen=True)
class Plan:
    """What ``up`` would do; printed by ``--dry-run``. A value: the steps that add to it
    (the planner's pick, the plan's notes) make a new one with ``dataclasses.replace``."""

    provider: str
    num_nodes: int
    region: str | None = None
    zone: str | None = None
    instance_type: str | None = None
    accelerators: str | None = None
    use_spot: bool = False
    hourly_price_per_node: float | None = None
    network: str | None = None
    """What the nodes talk over: "fast: EFA 4x100 Gb/s (400 Gb/s)", "plain (...)" (clouds)."""
    creates: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    alternatives: list[Plan] = field(default_factory=list)
    """When the planner chose the offer (no provider in the task): the next offers in rank
    order, which ``up`` fails over to when this one has no capacity or quota."""
    targets: tuple[Target, ...] = ()
    """The ranked targets ``up`` walks, the first one this plan's: with a planner's pick,
    one per offer (``alternatives`` are the plans of the others), across providers; else the
    named cloud's regions in order. Empty for providers that place nothing."""


@dataclass(frozen=True)
class ProviderContext:
    home: Path

    def cluster_dir(self, cluster: str) -> Path:
        """``home/clusters/<cluster>``: the name is checked, and the path must resolve inside
        ``home/clusters`` (nothing derived from a name can reach outside it)."""
        from cloudtrain.names import check, inside

        return inside(self.home / "clusters", check(cluster))


@runtime_checkable
class Provider(Protocol):
    name: ClassVar[str]
    options_model: ClassVar[type[BaseModel] | None]
    allows_absolute_mounts: ClassVar[bool]
    """Whether file_mounts may target absolute paths on the node (False where nodes share
    this machine's file system)."""
    powers_off: ClassVar[bool]
    """Whether ``terminate`` destroys machines (clouds) or only forgets them (ssh)."""
    list_is_cheap: ClassVar[bool]
    """Whether ``list_nodes`` is cheap enough for every ``status`` (no cloud API call)."""

    def check(self, request: ClusterRequest) -> None: ...

    def plan(self, request: ClusterRequest) -> Plan: ...

    def ensure_network(self, request: ClusterRequest) -> NetworkRef: ...

    def create_nodes(self, request: ClusterRequest, network: NetworkRef) -> list[Node]: ...

    def list_nodes(self, cluster: str) -> list[Node]: ...

    def terminate(self, cluster: str) -> None: ...


@runtime_checkable
class Places(Protocol):
    """What a cloud tells the placement step (``pipeline/place.py``) so that it can turn the
    ranked catalog offers into the cloud's :class:`Target` s; the ranking itself is the
    step's, done once per launch. The cloud base implements all of it; a cloud overrides
    what is its own (e.g. GCP: which machines get their GPUs attached)."""

    name: ClassVar[str]
    regions_hint: ClassVar[str]
    """The hint when the regions the task allows have no offer."""

    def offers(self) -> list[Offer]:
        """The catalog's offers of this cloud (what is ranked)."""
        ...

    def region_of(self, request: ClusterRequest) -> str | None:
        """The task's region (``resources.region``, or the region of ``resources.zone``)."""
        ...

    def wanted_regions(self, request: ClusterRequest, region: str | None) -> list[str]:
        """The regions the task and the cloud's options allow, in their order ([]: any, in
        price order)."""
        ...

    def target_of(self, offer: Offer, price: float | None) -> Target:
        """The target for one ranked offer."""
        ...

    def unpriced_target(self, request: ClusterRequest, region: str) -> Target:
        """The target for the task's own instance type in ``region``, where the catalog has
        no price for it."""
        ...

    def unlisted_targets(self, request: ClusterRequest, region: str | None,
                         offers: list[Offer]) -> list[Target]:
        """The targets when the ranking finds no offer and the task allows any region ([]:
        none; the ranking's error is then the answer)."""
        ...


# --- optional capabilities ---------------------------------------------------------------
# A provider declares one by having its method (or attribute); core code asks with
# ``isinstance(provider, HasMasterPort)``, never by probing with getattr. The cloud base
# (:class:`cloudtrain.provider.cloud.CloudProvider`) has all of them but ``HasMasterPort``,
# ``HasNodeEnv``, ``MarksOwner`` and ``ReportsInterruptions``.


@runtime_checkable
class HasMasterPort(Protocol):
    """The port torch's rendezvous uses on the head node (without it: 29500)."""

    def master_port(self, cluster: str) -> int: ...


@runtime_checkable
class HasNodeEnv(Protocol):
    """Variables handed to bootstrap on every node (e.g. ``CLOUDTRAIN_PYTHON``)."""

    def node_env(self, cluster: str) -> dict[str, str]: ...


@runtime_checkable
class HasHostKeySource(Protocol):
    """Where the host keys a provider gives in ``Node.host_keys`` come from, in words shown
    by ``status`` (without it: :data:`cloudtrain.keys.PINNED_AT_CREATION`)."""

    host_key_source: str


@runtime_checkable
class ReportsAttempts(Protocol):
    """Every placement attempt of the cluster's last ``up`` and its outcome, in order, as
    JSON objects with the same keys on every provider: region, zone, instance_type,
    outcome (ok, capacity, quota, unavailable, auth, throttled, error), code, message, at
    (see :class:`cloudtrain.provider.failover.Attempt`). ``up --json`` prints them."""

    def attempts(self, cluster: str) -> list[dict[str, Any]]: ...


@runtime_checkable
class ReportsInterruptions(Protocol):
    """Nodes the provider took back (spot interruptions) without a replacement yet, in
    words: what to tell the user instead of calling it a crash."""

    def interruptions(self, cluster: str) -> list[str]: ...


@runtime_checkable
class CollectsOrphans(Protocol):
    """``cloudtrain gc``: list what carries cloudtrain's marks and no live cluster owns, and
    remove it. The provider also has ``owner`` (this home's owner mark, a str); each
    resource has ``cluster``, ``owner``, ``kind``, ``name`` (see the clouds' teardown
    modules)."""

    def orphans(self, live: set[str], *, all_regions: bool = False,
                any_owner: bool = False) -> list[Any]: ...

    def remove(self, resources: list[Any]) -> None: ...


@runtime_checkable
class MarksOwner(Protocol):
    """The owner mark as the cloud stores it (e.g. a GCE label value), when it differs from
    the owner string: what gc compares resources' marks with."""

    def owner_mark(self, owner: str) -> str: ...


@runtime_checkable
class Allocates(Protocol):
    """A scheduler the user already has (Slurm): a cluster is one allocation job, its nodes are
    reached through the scheduler (job steps), never over SSH by cloudtrain, and ``up`` ends
    once the allocation runs. ``allocation_words``: the allocation's job id, state and time
    left, in words, for ``status`` (None: it has none)."""

    def allocation_words(self, cluster: str) -> str | None: ...


@runtime_checkable
class RunsSteps(Protocol):
    """A scheduler's provider runs a job as one step of the cluster's allocation: the local
    ``workdir`` (None: nothing) synced to the shared filesystem through the login node with
    rsync's ``filters`` (what is never sent), then ``script`` (bash) run once on every node
    with ``env`` exported, every output line handed to ``line(rank, text)``; ``gpus_per_job``
    (None: whole nodes) is the step's share of each node, so that the scheduler packs steps
    that fit and holds the others until they do. Returns each node's exit code, by rank, as
    the scheduler says, in the order it reported the nodes' ends (the first failure first;
    a node a signal ended: 128 + the signal)."""

    def run_step(self, cluster: str, job_id: str, workdir: Path | None, filters: list[str],
                 script: str, env: Mapping[str, str], line: Callable[[int, str], None],
                 gpus_per_job: int | None = None) -> dict[int, int]: ...


@runtime_checkable
class BootstrapsSteps(Protocol):
    """A scheduler's bootstrap, from inside the allocation: find the Python with PyTorch (or,
    with ``need_torch``, build one with pip's ``torch`` requirement from ``torch_index``) and
    check each node's GPUs; once per allocation; progress to ``say``."""

    def bootstrap_steps(self, cluster: str, torch: str, torch_index: str | None,
                        need_torch: bool, say: Callable[[str], None]) -> None: ...


@runtime_checkable
class ExecsSteps(Protocol):
    """``exec`` on a scheduler's cluster: ``command`` (bash) as a step of the allocation that
    runs beside any job there, on the nodes ``ranks`` (None: every node), in the workdir with
    ``env``; lines to ``line(rank, text)``; each node's exit code by rank."""

    def exec_step(self, cluster: str, job_id: str, command: str, env: Mapping[str, str],
                  line: Callable[[int, str], None], ranks: list[int] | None
                  ) -> dict[int, int]: ...


NodeState = Literal["running", "lost", "unknown"]


@dataclass(frozen=True)
class NodeHealth:
    """What the CLOUD says of one node (never inferred from SSH): ``running``; ``lost`` when
    the cloud took or ended it (terminated, preempted, evicted, spot interruption, gone from
    the listing; on the local provider: its sshd process has exited); ``unknown`` when the
    cloud could not be asked (an API error): not a loss."""

    rank: int
    instance_id: str
    state: NodeState
    reason: str = ""
    """In words, for the user and the ledger (e.g. "spot instance terminated: capacity")."""


@runtime_checkable
class ReportsNodeHealth(Protocol):
    """The provider can tell, from the cloud itself, which nodes of a cluster it took (the
    recovery controller's only evidence of a loss), and clear what a lost node left so that
    provisioning again creates a fresh one in its rank."""

    def node_health(self, cluster: str) -> list[NodeHealth]:
        """One entry per rank the cluster should have (missing instances are ``lost``)."""
        ...

    def discard_nodes(self, cluster: str, ranks: list[int]) -> None:
        """Remove what is left of these lost nodes (a stopped preempted VM, an evicted one,
        a dead local node's directory), so ``create_nodes`` makes new ones in those ranks.
        Never touches the other ranks."""
        ...


@dataclass(frozen=True)
class SelfStop:
    """What the cloud shows of a node that ended its own billing (the node guard's last act):
    when it stopped (the cloud's own record where it has one, e.g. a state-transition time),
    and why, when the node could leave a reason where the provider reads it without
    credentials on the node (e.g. a serial-console line ``cloudtrain-guard: stop: idle``),
    else ``None``."""

    rank: int
    instance_id: str
    stopped_at: float
    reason: str | None = None


@runtime_checkable
class SelfStops(Protocol):
    """Nodes of this provider can end their own billing for compute with NO user credential
    on the node. The node guard (``cloudtrain/node/guard.py``) runs
    :meth:`self_stop_command` as its last act, when a policy fires (idle, job end, budget,
    lifetime); at the next CLI contact :meth:`self_stopped` tells what it did, and
    ``terminate`` removes what a self-stop leaves behind (security group, key pair, disks)."""

    def self_stop_command(self, cluster: str, node: Node) -> str:
        """A POSIX shell command, run on ``node`` as its login user by the guard, that stops
        this node's compute billing (e.g. ``sudo shutdown -h now`` where the cloud terminates
        an instance on guest shutdown). ``$CT_GUARD_REASON`` holds the reason (idle, job-end,
        budget, lifetime) when it runs. It may not return (the machine goes away)."""
        ...

    def what_still_bills(self) -> str:
        """One sentence for ``up``/docs: what may still bill after a self-stop until the next
        CLI contact (or ``gc``) removes it."""
        ...

    def self_stopped(self, cluster: str) -> list[SelfStop]:
        """The cluster's nodes that stopped themselves, from the cloud (or, for local nodes,
        their files). [] when none did."""
        ...


@dataclass(frozen=True)
class ProviderCheck:
    """What ``cloudtrain check`` found of one provider: its SDK installed or not; where its
    credentials were found, in words (None: none found); whether a cheap read-only call with
    them worked (None: not tried, e.g. no credentials, or no answer in time); what they reach
    (account, project, subscription, regions), in words; ``detail`` (what went wrong, or a
    note) and ``fix`` (what to do next, "" when nothing is needed)."""

    provider: str
    sdk: bool
    credentials: str | None
    works: bool | None
    reaches: tuple[str, ...] = ()
    detail: str = ""
    fix: str = ""

    @property
    def usable(self) -> bool:
        """The SDK is installed, credentials were found and the read-only call worked."""
        return self.sdk and self.credentials is not None and self.works is True


@runtime_checkable
class ChecksAccess(Protocol):
    """``cloudtrain check``: the provider finds its credentials and tries them with one cheap,
    read-only call (each network call bounded by ``timeout`` seconds), creating nothing. It
    returns what it found, never raises for missing or refused credentials."""

    def check_access(self, timeout: float) -> ProviderCheck: ...


@runtime_checkable
class StopsNodes(Protocol):
    """The user can stop this provider's nodes and start them again (``cloudtrain stop`` /
    ``start``): compute stops billing, each node keeps its disk and files. Starting goes
    through ``create_nodes``, which starts a cluster's stopped nodes (it adopts what exists)."""

    def stop_nodes(self, cluster: str) -> None:
        """Stop every node carrying the cluster's tag (only those), returning once the
        provider reports each one stopped. Safe to call twice."""
        ...

    def stopped_still_bills(self, cluster: str) -> str:
        """One sentence: what still bills while the cluster's nodes are stopped."""
        ...
