"""The transport: membership-epoch-scoped communicators over gloo (CPU) and NCCL (GPU), one module per
seam. actors/transport/comm.py re-exports what the rest of the repository uses; the contract itself (errors,
`GroupSpec`, `Handle`, `Communicator`) is core/comm_api.py.

A group belongs to one membership epoch and is never reused; its name is
`<job>/<run id>/c<incarnation>/e<epoch>`. Buffers handed to an aborted group are abandoned (the stuck
operation may still write into them until its own timeout), and failed groups are closed in the
background. Either backend's group is also reachable through `ray.util.collective` (actors/transport/collective.py).

- `base`: the handle of a pending operation, the state every group shares, the group-less epoch, and
  the operations both backends run alike.
- `signed_store`: the signed rendezvous store (a group's view of the coordinator's store).
- `gloo`: the CPU communicator; `sockets`: the Linux socket scraping that shuts a gloo group's pairs.
- `nccl`: the GPU communicator and its CUDA event poller.
- `formation`: forming a group in a helper thread, formation errors, release in the background.
- `stores`: store clients, and the in-process stores of tests.
- `factory`: `make_communicator` (one epoch's group) and `in_process_group` (tests).
"""
