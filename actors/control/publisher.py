"""The publisher: the publication of each plan.

The book decides the next plan; the publisher names the group store its members rendezvous on (the
one its rank 0 serves: every worker serves a store of its own, actors/training/worker.py `HostedStore`, so
the coordinator serves none and never loads torch), hands the plan to every reachable member (and
the membership to the parameter server first, since the server admits a membership before its
members pull under it), then saves the coordinator's state. It also aborts an epoch's collectives,
once per epoch however many deaths ask for it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from actors.control.book import MembershipBook
from actors.control.workers import WorkerGroup
from actors.plan import Plan
from algorithms.rules.kinds import Kind


class Publisher:
    """Publishes plans; aborts epochs."""

    def __init__(self, book: MembershipBook, group: WorkerGroup, kind: Kind, incarnation: int,
                 server: Callable[[], Any], persist: Callable[[], int], died_publishing: Callable[[int, list], None]) -> None:
        """`kind`: the policy's kind; `server()`: the parameter server's control or None; `persist()`:
        save the coordinator's state; `died_publishing(version, sent)`: an injected fault's hook."""
        self.book, self.group, self.kind, self.incarnation = book, group, kind, incarnation
        self._server, self._persist, self._died_publishing = server, persist, died_publishing
        self._aborted = -1
        """The membership epoch last aborted."""

    def store_of(self, members: tuple[str, ...]) -> tuple[str, int]:
        """(host, port) of the group store the plan over `members` names: its rank 0's (or the first
        member's that reported one; port 0 when none did, as for a server kind's workers)."""
        for slot in members:
            member = self.book.members.get(slot)
            if member is not None and member.store_port:
                return member.node, member.store_port
        return self.group.node_ip, 0

    def publish(self, members: tuple[str, ...], reason: str, history_step: int, new_epoch: bool = False,
                aborts: bool = False) -> Plan:
        """The book's next plan over `members`, handed to every reachable member; saved. With `aborts`,
        the copy sent also aborts the current epoch (`Plan.aborts_epoch`; once per epoch, as
        `abort_epoch`)."""
        previous = self.book.plan
        ending = self.book.epoch if aborts and self._aborted != self.book.epoch else None
        host, port = self.store_of(members)
        plan = self.book.next_plan(members, reason, incarnation=self.incarnation, store_host=host,
                                   store_port=port, history_step=history_step, new_epoch=new_epoch)
        server = self._server()
        if server is not None:
            server.set_members(self.book.epoch, self.book.server_membership())
        sent_plan = plan
        if ending is not None:
            self._aborted = ending
            sent_plan = dataclasses.replace(plan, aborts_epoch=ending)
        sent = [self.group.set_plan(m.handle, sent_plan) for m in self.book.reachable()]
        self._died_publishing(plan.version, sent)
        self._persist()
        if previous is not None and self.kind.new_epoch_each_plan:
            for member in self.book.reachable():  # the old epoch's number: a member already in the new one is left alone
                self.group.abort_epoch(member.handle, previous.membership_epoch, f"plan {plan.version}: {reason}")
        return plan

    def abort_epoch(self, reason: str) -> None:
        """Every member's collectives of the current epoch fail now; once per epoch (a batch of deaths,
        or a death found by a probe and then by its watch, aborts it once)."""
        if self._aborted == self.book.epoch:
            return
        self._aborted = self.book.epoch
        for member in self.book.reachable():
            self.group.abort_epoch(member.handle, self.book.epoch, reason)

