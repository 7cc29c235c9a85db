"""The publisher: the job's group store and the publication of each plan.

It owns the group store that each membership epoch's members rendezvous on (served from a thread
of the coordinator's process once torch.distributed has loaded there, with the keys of older
epochs dropped as a new one enters), and the act of publishing: the book decides the next plan,
the publisher hands it to every reachable member (and the membership to the parameter server
first, since the server admits a membership before its members pull under it), then saves the
coordinator's state. It also aborts an epoch's collectives, once per epoch however many deaths
ask for it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Callable

from actors.control.book import MembershipBook
from actors.control.workers import WorkerGroup
from actors.plan import Plan


class Publisher:
    """Serves the group store; publishes plans; aborts epochs."""

    def __init__(self, book: MembershipBook, group: WorkerGroup, store_up: concurrent.futures.Future,
                 kind: str, incarnation: int, server: Callable[[], Any], persist: Callable[[], int],
                 died_publishing: Callable[[int, list], None]) -> None:
        """`store_up`: the store being opened (its result is (port, epoch keys, what keeps it alive));
        `kind`: the policy's kind; `server()`: the parameter server's control or None; `persist()`:
        save the coordinator's state; `died_publishing(version, sent)`: an injected fault's hook."""
        self.book, self.group, self.kind, self.incarnation = book, group, kind, incarnation
        self._store_up, self._server, self._persist, self._died_publishing = store_up, server, persist, died_publishing
        self.store_port, self._epoch_keys, self._store_keep = 0, None, None
        self._aborted = -1
        """The membership epoch last aborted."""

    async def serve_store(self) -> None:
        """Wait for the job's group store (needed from the first plan on)."""
        if self._epoch_keys is None:
            await asyncio.wrap_future(self._store_up)
            self._take_store()

    def _take_store(self) -> None:
        if self._epoch_keys is None:  # a publication before `serve_store` (not expected) waits here
            self.store_port, self._epoch_keys, self._store_keep = self._store_up.result()

    def publish(self, members: tuple[str, ...], reason: str, history_step: int, new_epoch: bool = False) -> Plan:
        """The book's next plan over `members`, handed to every reachable member; saved."""
        self._take_store()
        previous = self.book.plan
        plan = self.book.next_plan(members, reason, incarnation=self.incarnation, store_host=self.group.node_ip,
                                   store_port=self.store_port, history_step=history_step, new_epoch=new_epoch)
        if previous is None or plan.membership_epoch != previous.membership_epoch:
            self._epoch_keys.entered(plan.group_name, len(members), plan.backend)  # older epochs' keys go
        server = self._server()
        if server is not None:
            server.set_members(self.book.epoch, self.book.server_membership())
        sent = [self.group.send(m.handle, "set_plan", plan) for m in self.book.reachable()]
        self._died_publishing(plan.version, sent)
        self._persist()
        if previous is not None and self.kind == "decentralized":
            for member in self.book.reachable():  # the old epoch's number: a member already in the new one is left alone
                self.group.send(member.handle, "abort_epoch", previous.membership_epoch, f"plan {plan.version}: {reason}")
        return plan

    def abort_epoch(self, reason: str) -> None:
        """Every member's collectives of the current epoch fail now; once per epoch (a batch of deaths,
        or a death found by a probe and then by its watch, aborts it once)."""
        if self._aborted == self.book.epoch:
            return
        self._aborted = self.book.epoch
        for member in self.book.reachable():
            self.group.send(member.handle, "abort_epoch", self.book.epoch, reason)

