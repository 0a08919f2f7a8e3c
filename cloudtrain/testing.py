"""A provider that lives in memory, for tests of code that drives providers (cloudtrain's own and
an embedding program's), the way an HTTP client's mock transport stands in for the network.

:class:`MemoryProvider` keeps the contract of :class:`cloudtrain.provider.contract.Provider`
and creates nothing: its clusters' networks and nodes are entries in dictionaries, its plans
price what it is told, and its ``create_nodes`` fails when told to, with the errors a cloud
raises (``CapacityError``, ``QuotaError``, ...), optionally after a few nodes were made, as a
half-built cluster. Everything asked of it is recorded in ``calls``.

Hand it in through the :class:`~cloudtrain.context.Env` (nothing is registered globally)::

    fake = MemoryProvider.named("aws", price=3.0)
    env = Env(home, open_state(home), UI(quiet=True), providers={"aws": fake})

or to the command line run in-process, as click's context object::

    CliRunner().invoke(cli, ["up", "task.yaml", "-y"], obj={"aws": fake})

Its nodes have invented addresses (10.0.0.x): it is for what happens around a provider
(planning, failover, rollback, the ledger, status), not for reaching nodes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from cloudtrain.provider.contract import ClusterRequest, NetworkRef, Node, Plan

if TYPE_CHECKING:
    from pydantic import BaseModel

    from cloudtrain.errors import CloudtrainError

__all__ = ["MemoryProvider"]


class MemoryProvider:
    """A provider holding its clusters in memory.

    ``price``: the hourly price per node its plans give (None: free). ``fail_with``: an error
    every ``create_nodes`` raises until it is set back to None (e.g.
    ``CapacityError("no capacity in zone a")``); ``partial``: how many nodes it makes first,
    which stay until ``terminate``.

    What it was asked, in order, is in ``calls``: ``"check"``, ``"plan"``, ``"network"``,
    ``"create <instance type> <region>"``, ``"terminate"``. ``nodes`` and ``networks`` hold
    each cluster's nodes and network; ``terminated`` the clusters terminated.
    """

    name: ClassVar[str] = "memory"
    options_model: ClassVar[type[BaseModel] | None] = None
    allows_absolute_mounts: ClassVar[bool] = True
    powers_off: ClassVar[bool] = True
    list_is_cheap: ClassVar[bool] = True

    def __init__(self, *, price: float | None = None, fail_with: CloudtrainError | None = None,
                 partial: int = 0) -> None:
        self.price = price
        self.fail_with = fail_with
        self.partial = partial
        self.calls: list[str] = []
        self.nodes: dict[str, list[Node]] = {}
        self.networks: dict[str, NetworkRef] = {}
        self.terminated: list[str] = []

    @classmethod
    def named(cls, name: str, *, price: float | None = None,
              fail_with: CloudtrainError | None = None, partial: int = 0) -> MemoryProvider:
        """One standing in for provider ``name`` (e.g. ``"aws"``): its plans and nodes say
        ``name``. The name is a class attribute in the contract, so this is a subclass."""
        kind = type(f"MemoryProvider_{name}", (cls,), {"name": name})
        made: MemoryProvider = kind(price=price, fail_with=fail_with, partial=partial)
        return made

    # --- the contract -------------------------------------------------------------------------

    def check(self, request: ClusterRequest) -> None:
        self.calls.append("check")

    def plan(self, request: ClusterRequest) -> Plan:
        self.calls.append("plan")
        r = request.resources
        return Plan(provider=self.name, num_nodes=request.num_nodes, region=r.region,
                    instance_type=r.instance_type, use_spot=r.use_spot,
                    hourly_price_per_node=self.price,
                    creates=[f"{request.num_nodes} x {r.instance_type} in {r.region}"])

    def ensure_network(self, request: ClusterRequest) -> NetworkRef:
        self.calls.append("network")
        return self.networks.setdefault(request.name, NetworkRef(f"{self.name}-net-{request.name}"))

    def create_nodes(self, request: ClusterRequest, network: NetworkRef) -> list[Node]:
        """Makes the nodes the cluster lacks (those it has are kept: idempotent), or, with
        ``fail_with``, ``partial`` of them and then raises it."""
        self.calls.append(f"create {request.resources.instance_type} {request.resources.region}")
        have = self.nodes.setdefault(request.name, [])
        want = request.num_nodes if self.fail_with is None else min(self.partial,
                                                                     request.num_nodes)
        have += [self._node(rank) for rank in range(len(have), want)]
        if self.fail_with is not None:
            raise self.fail_with
        return list(have)

    def list_nodes(self, cluster: str) -> list[Node]:
        return list(self.nodes.get(cluster, []))

    def terminate(self, cluster: str) -> None:
        """Forgets the cluster's nodes and network; safe on a cluster it never saw."""
        self.calls.append("terminate")
        self.nodes.pop(cluster, None)
        self.networks.pop(cluster, None)
        self.terminated.append(cluster)

    def _node(self, rank: int) -> Node:
        return Node(rank=rank, instance_id=f"{self.name}-{rank}", host=f"10.0.0.{rank + 1}")
