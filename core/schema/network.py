"""Where the job runs: the lab's emulated (or a real cluster's described) network, the communicator's
settings, and Ray."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from core.schema.errors import DAY_S, FieldError, at_least, within


@dataclass
class LinkConfig:
    """One kind of link of the lab's emulated network."""

    mbit: float | None = None
    """Bandwidth in Mbit/s, each direction, shaped by the kernel (`tc` htb); none: unshaped loopback."""
    latency_ms: float = 0.0
    """One-way latency, modelled in the transport (no netem here): every collective whose members span
    the link completes no sooner than its sequential message rounds times this after its launch. In
    [0, 60000] ms: a minute one way is far beyond any real link (a geostationary hop is about 300 ms),
    and a ring's 2(n-1) rounds of it must still fit `comm.timeout_s`."""

    def __post_init__(self) -> None:
        if self.mbit is not None and self.mbit <= 0:
            raise FieldError("mbit", f"must be positive (or unset for unshaped), got {self.mbit}")
        within(self, "latency_ms", 0.0, 60000.0, unit=" ms")


@dataclass
class PairLink(LinkConfig):
    """A per-pair override: the link between virtual nodes `a` and `b` (both directions)."""

    a: int = 0
    b: int = 1


@dataclass
class NetworkConfig:
    """An emulated multi-node network on one machine (the lab; orchestrator/lab.py). Slot `w<i>` runs on
    virtual node `i // workers_per_node` (modulo `nodes`), whose address is the `i`-th host of `subnet`
    (127.77.0.1 for node 0 by default); the kernel shapes traffic between different nodes' addresses.
    `nodes: 0` (the default) is no lab. With `emulate: false` the section describes a real cluster's
    links instead, for `plan` and `sync.policy: auto` to rank on (as told): nothing is shaped, no lab
    comes up, and the workers run where Ray places them."""

    nodes: int = 0
    workers_per_node: int = 1
    intra: LinkConfig = field(default_factory=LinkConfig)
    """Links between workers of one node (unshaped unless set)."""
    inter: LinkConfig = field(default_factory=lambda: LinkConfig(mbit=1000.0, latency_ms=0.1))
    """Links between nodes, unless `links` names the pair."""
    links: list[PairLink] = field(default_factory=list)
    subnet: str = "127.77.0.0/24"
    """Loopback addresses of the virtual nodes (all of 127/8 is this machine); nothing outside is shaped."""
    emulate: bool = True
    """True: the lab emulates this network on this machine. False: it describes the real cluster the job
    runs on (`nodes` of `workers_per_node` ranks each, `inter`/`intra`/`links` as measured or specified
    elsewhere), which only the planner reads."""

    def __post_init__(self) -> None:
        at_least(self, "nodes", 0)
        at_least(self, "workers_per_node", 1)
        match = re.fullmatch(r"127\.(\d{1,3})\.(\d{1,3})\.0/24", self.subnet)
        if not match or any(int(g) > 255 for g in match.groups()) or self.subnet.startswith("127.0.0."):
            raise FieldError("subnet", f"must be a /24 inside 127.0.0.0/8 other than 127.0.0.0/24 (e.g. "
                                       f"127.77.0.0/24), got {self.subnet!r}")
        if self.nodes > 250:
            raise FieldError("nodes", f"at most 250 virtual nodes fit a /24, got {self.nodes}")
        for i, link in enumerate(self.links):
            if not (0 <= link.a < self.nodes and 0 <= link.b < self.nodes) or link.a == link.b:
                raise FieldError(f"links[{i}]", f"a and b must be two different nodes of 0..{self.nodes - 1}, "
                                                f"got {link.a} and {link.b}")

    @property
    def enabled(self) -> bool:
        """A network is described (emulated by the lab, or told for a real cluster)."""
        return self.nodes > 0

    @property
    def lab(self) -> bool:
        """The lab emulates it on this machine (shaping, virtual node addresses, modelled latency)."""
        return self.nodes > 0 and self.emulate

    def address(self, node: int) -> str:
        return self.subnet.rsplit(".", 1)[0] + f".{node + 1}"

    def node_of(self, slot: str) -> int:
        return (int(slot[1:]) // self.workers_per_node) % self.nodes

    def link(self, a: int, b: int) -> LinkConfig:
        """The link between nodes `a` and `b` (`intra` when they are the same node)."""
        if a == b:
            return self.intra
        for pair in self.links:
            if {pair.a, pair.b} == {a, b}:
                return pair
        return self.inter


@dataclass
class CommConfig:
    timeout_s: float = 10.0
    """One timeout for every collective, the store and group construction (unless
    `formation_timeout_s` is set), in [0.1, 86400] s: below
    0.1 s a healthy all-reduce or store round trip on a loaded node misses it; above a day a wait is a
    hang, and gloo's and the store's `timedelta`s overflow (1e300 failed every worker's start)."""
    formation_timeout_s: float | None = None
    """How long a membership epoch's group may take to form (the store's rendezvous, the connections,
    NCCL's communicator: seconds at 64 ranks on a cold start), in [0.1, 86400] s; unset: `timeout_s`.
    `timeout_s` then bounds each operation, and can stay tight."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    sign_rendezvous: bool = True
    """Each job's rendezvous values are signed with a secret only its actors hold, and a value without
    that signature is refused. `false` exists to measure what signing costs (benchmarks/startup.py);
    without it, anything that reaches the coordinator's store port can steer a job's groups."""

    def __post_init__(self) -> None:
        within(self, "timeout_s", 0.1, DAY_S, unit=" s")
        if self.formation_timeout_s is not None:
            within(self, "formation_timeout_s", 0.1, DAY_S, unit=" s")


@dataclass
class RayConfig:
    address: str | None = None
    """Ray address; none starts (or reuses) a local Ray."""
    namespace: str = "orchestrator"
    """The Ray namespace of the job's actors. Only `orchestrator` works: the driver, the CLI and the
    workers find the coordinator there (orchestrator/connection.py `NAMESPACE`), so any other is refused."""
    num_cpus: int | None = None
    """Logical CPUs of a local Ray; defaults to at least workers.max x workers.cpus."""
    coordinator_resources: dict = field(default_factory=dict)
    """Custom resources the coordinator asks for (a small amount of each), e.g. `{coordinator: 0.01}`.
    Empty: the head node, which lives as long as the cluster. Name a resource that several nodes have
    to let Ray restart the coordinator on another node when its node is lost; its run files must then
    be on shared storage (`storage: s3://...`)."""

    def __post_init__(self) -> None:
        if self.namespace != "orchestrator":
            raise FieldError("namespace", f"only orchestrator works (the driver, the CLI and the workers find the "
                                          f"coordinator there); leave it out, got {self.namespace!r}")
        for name, amount in self.coordinator_resources.items():
            if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not 0 < amount <= 1:
                raise FieldError(f"coordinator_resources.{name}", f"an amount in (0, 1] (got {amount!r})")
