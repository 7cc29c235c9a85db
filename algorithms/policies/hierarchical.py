"""BAGUA's hierarchical all-reduce over one group, by point-to-point messages. Pure: the communicator
is injected (algorithms/ never imports a backend).

Where the links between nodes are the slow ones, a flat ring all-reduce sends 2(n-1)/n of the payload
across them for every rank; reducing within each node first sends it once per node:

1. each member sends its tensor to its node's leader (the node's lowest rank), which sums its node's
   tensors in rank order;
2. the leaders all-reduce among themselves over the slow links: on a group of the leaders alone
   (`comm.subgroup`, formed at the epoch's first all-reduce; gloo's ring), or, where the backend
   forms no subgroup, a ring of point-to-point messages (reduce-scatter, then all-gather, each k-1
   rounds of one chunk to the next leader);
3. each leader sends the sum back to its node's members.

Every rank ends with the same SUM, which equals the flat all-reduce's up to the order of the float
additions. Nodes come from the membership epoch (`EpochInfo.nodes`: the lab's virtual node of each
member, or the Ray node it runs on). Blocking; a failed message raises the communicator's CommError.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch

from core.comm_api import Communicator


class HierarchicalAllReduce:
    def __init__(self, comm: Communicator, rank: int, nodes: Sequence[str]) -> None:
        self.comm, self.rank = comm, rank
        order: dict[str, list[int]] = {}
        for r, node in enumerate(nodes):
            order.setdefault(node, []).append(r)
        self.members = order[nodes[rank]]
        """This rank's node's ranks, in rank order; the first is its leader."""
        self.leader = self.members[0]
        self.leaders = [ranks[0] for ranks in sorted(order.values())]
        self.bytes_sent = 0
        self._leader_group: Communicator | Literal[False] | None = None
        """The leaders' own group (`comm.subgroup`), once formed; False where the backend has none."""

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    def all_reduce(self, tensor: torch.Tensor,
                   among: Callable[[torch.Tensor, Communicator], None] | None = None) -> None:
        """SUM `tensor` over every rank of the group, in place. `among(flat, leaders_group)`, where given,
        replaces the leaders' plain all-reduce of their nodes' sums (a compressed scatter-gather on the
        leaders' own group; it needs a backend that forms one)."""
        flat = tensor.view(-1)
        if not self.is_leader:
            self._send(flat, self.leader)
            self.comm.recv(flat, self.leader).wait()
            return
        incoming = torch.empty_like(flat)
        for member in self.members[1:]:
            self.comm.recv(incoming, member).wait()
            flat.add_(incoming)
        if among is not None and len(self.leaders) > 1:
            group = self.leader_group()
            if group is None:
                raise RuntimeError("sync.hierarchical with a codec needs a backend that forms subgroups (gloo)")
            among(flat, group)
        else:
            self._among_leaders(flat)
        for member in self.members[1:]:
            self._send(flat, member)

    def _send(self, flat: torch.Tensor, dst: int) -> None:
        self.comm.send(flat, dst).wait()
        self.bytes_sent += flat.numel() * flat.element_size()

    def leader_group(self) -> Communicator | None:
        """The leaders' own group (formed on the first call, by every leader at once), or None where the
        backend forms no subgroup."""
        if self._leader_group is None:
            group = self.comm.subgroup(self.leaders, "leaders")
            self._leader_group = group if group is not None else False
        return self._leader_group or None

    def _among_leaders(self, flat: torch.Tensor) -> None:
        k = len(self.leaders)
        if k <= 1:
            return
        group = self.leader_group()
        if group is None:
            self._ring(flat)
            return
        before = group.bytes_sent
        group.all_reduce(flat).wait()
        sent = group.bytes_sent - before  # the leaders' group counts its own; the job reads the epoch's group
        self.bytes_sent += sent
        self.comm.bytes_sent += sent

    def _ring(self, flat: torch.Tensor) -> None:
        """Ring all-reduce (SUM) of `flat` among the leaders: k-1 reduce-scatter rounds, k-1 all-gather rounds."""
        k = len(self.leaders)
        if k <= 1:
            return
        me = self.leaders.index(self.rank)
        after, before = self.leaders[(me + 1) % k], self.leaders[(me - 1) % k]
        bounds = [flat.numel() * i // k for i in range(k + 1)]
        chunk = lambda c: flat[bounds[c]:bounds[c + 1]]  # noqa: E731
        scratch = torch.empty(bounds[1] - bounds[0] + 1, dtype=flat.dtype, device=flat.device)
        for r in range(k - 1):  # reduce-scatter: after it, leader `me` holds the sum of chunk (me + 1) % k
            out, into = chunk((me - r) % k), chunk((me - r - 1) % k)
            recv = scratch[:into.numel()]
            self.comm.exchange([(out, after)], [(recv, before)]).wait()
            self.bytes_sent += out.numel() * out.element_size()
            into.add_(recv)
        for r in range(k - 1):  # all-gather the summed chunks
            out, into = chunk((me + 1 - r) % k), chunk((me - r) % k)
            self.comm.exchange([(out, after)], [(into, before)]).wait()
            self.bytes_sent += out.numel() * out.element_size()
