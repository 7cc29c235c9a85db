"""Membership-epoch-scoped communicator: one interface over gloo (CPU) and NCCL (GPU).

Every operation is asynchronous and returns a handle whose `wait(timeout)` honours three things at
once: the operation finishing, one timeout (`comm.timeout_s`) and an epoch abort raised from the
control thread when the coordinator learns of a death. This module is the transport's front door: the
contract (errors, `GroupSpec`, `Handle`, `Communicator`) lives in core/comm_api.py, the implementation
in actors/transport/ (one module per seam: its docstring lists them), and both are re-exported here.
"""
from __future__ import annotations

from actors.transport.base import BaseCommunicator, NoGroup, WorkHandle
from actors.transport.factory import in_process_group, make_communicator
from actors.transport.formation import form_in_thread
from actors.transport.gloo import GlooCommunicator
from actors.transport.nccl import NCCL_WATCHDOG_MARGIN_S, NcclCommunicator
from actors.transport.signed_store import SignedStore, group_store
from actors.transport.store import GROUP_SUFFIXES, EpochKeys, group_keys, serve_store
from actors.transport.stores import client_store, in_process_store
from core.comm_api import CommAborted, CommError, CommTimeout, Communicator, ForgedRendezvous, GroupSpec, Handle

__all__ = [
    "GROUP_SUFFIXES", "NCCL_WATCHDOG_MARGIN_S", "BaseCommunicator", "CommAborted", "CommError", "CommTimeout",
    "Communicator", "EpochKeys", "ForgedRendezvous", "GlooCommunicator", "GroupSpec", "Handle", "NcclCommunicator",
    "NoGroup", "SignedStore", "WorkHandle", "client_store", "form_in_thread", "group_keys", "group_store",
    "in_process_group", "in_process_store", "make_communicator", "serve_store",
]
