"""The GPU tier (`pytest -m gpu`): skipped, with the reason, where no CUDA device is present.

One GPU cannot hold two NCCL ranks (NCCL refuses a duplicate device), so NCCL runs at world size 1
here, and several workers share the GPU over gloo with CUDA tensors; tests that need two GPUs
are marked `gpu2` and skip on one. Replicas run in threads of the test process (no Ray) except in
the kill-and-join run, which uses the real actors.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from actors.transport.comm import CommAborted, CommTimeout, GroupSpec, make_communicator
from testkit.harness import LocalJob, local_store

CUDA = torch.cuda.is_available()
GPUS = torch.cuda.device_count() if CUDA else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (none is present)")]
needs_nccl = pytest.mark.skipif(CUDA and not torch.distributed.is_nccl_available(),
                                reason="needs a torch built with NCCL")
"""Without CUDA the module's own mark skips first, naming the missing GPU."""
needs_two = pytest.mark.skipif(CUDA and GPUS < 2, reason="gpu2: needs two GPUs (one GPU cannot hold two NCCL ranks)")

SGD = {"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.001}


def config(n: int, gpus: float, backend: str, sync: dict | None = None, steps: int = 20, hidden: int = 16) -> dict:
    """The oracle's job (its model, hidden 16, is the one `cpu_reference` trains; tests/unit/
    test_gpu_tier_on_cpu.py runs it on the CPU, where a mismatch shows before a GPU is lent)."""
    return {"name": "gpu", "seed": 3, "workers": {"count": n, "cpus": 1, "gpus": gpus},
            "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": hidden}, "batch_size": 16},
            "optimizer": SGD, "sync": sync or {"policy": "bsp", "bucket_mb": 0.004}, "comm": {"backend": backend},
            "stop": {"max_steps": steps}, "eval_every": 0}


def cpu_reference(global_batch: int, steps: int = 20) -> list[torch.Tensor]:
    from tests.unit.test_policy_oracles import reference_bsp  # the in-process oracles' reference
    return reference_bsp(SGD, global_batch, steps)


def run_local(tmp_path, n: int, gpus: float, backend: str, **kw) -> LocalJob:
    slots = [f"w{i}" for i in range(n)]
    job = LocalJob(config(n, gpus, backend, **kw), slots, str(tmp_path))
    job.run(tuple(slots), 16 * n, backend=backend)
    return job


def test_bsp_oracle_on_cuda_two_workers_sharing_one_gpu_over_gloo(tmp_path):
    job = run_local(tmp_path, 2, 0.5, "gloo")
    params = job.parameters("w0")
    assert all(p.is_cuda for p in job.replicas["w0"].training.model.parameters())
    diff = max(float((p.cpu() - q).abs().max()) for p, q in zip(params, cpu_reference(32)))
    print(f"BSP on CUDA, 2 workers over gloo vs single-process CPU: {diff:.2e}")
    assert diff < 1e-5


@needs_nccl
@pytest.mark.parametrize("engine", ["reducer", "python"])
def test_bsp_oracle_on_nccl_at_world_size_1(tmp_path, engine):
    """torch's ProcessGroupNCCL under torch's C++ reducer (the `auto` choice on whole GPUs) and under
    the Python buckets: both equal single-process SGD on the CPU."""
    job = run_local(tmp_path, 1, 1, "nccl", sync={"policy": "bsp", "bucket_mb": 0.004, "engine": engine})
    impl = job.replicas["w0"].policy.impl
    assert (impl.reducer is not None) == (engine == "reducer")
    assert all(p.is_cuda for p in job.replicas["w0"].training.model.parameters())
    diff = max(float((p.cpu() - q).abs().max()) for p, q in zip(job.parameters("w0"), cpu_reference(16)))
    print(f"BSP over NCCL (world size 1, engine {engine}) vs single-process CPU: {diff:.2e}")
    assert diff < 1e-5


@needs_nccl
def test_auto_engine_takes_the_reducer_on_nccl(tmp_path):
    job = run_local(tmp_path, 1, 1, "nccl", steps=3)
    assert job.replicas["w0"].policy.impl.reducer is not None


def _released_groups(timeout: float = 60.0) -> float:
    """Wait for the earlier epochs' groups to be released (each `close` runs in a thread of that name,
    which ends once its group is shut down); the seconds it took."""
    started = time.monotonic()
    for thread in [t for t in threading.enumerate() if t.name.startswith("close ")]:
        thread.join(max(0.0, timeout - (time.monotonic() - started)))
        assert not thread.is_alive(), f"{thread.name} still releasing its group after {timeout:.0f}s"
    return time.monotonic() - started


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_no_gpu_memory_left_behind_over_20_membership_changes(tmp_path, backend):
    """20 membership epochs of one replica (each a fresh group, its buffers and, with the reducer,
    its buckets): once the earlier epochs' groups are released, the GPU memory allocated after the
    last epoch is what it was after the first, to less than one set of gradient buckets. The model
    (hidden 1024: 4.3 MiB of gradients) makes one leaked set stand well above what NCCL's own small
    allocations move by (about 70 KiB).

    An old epoch's buffers are freed when its group's release (in the background) ends: on an H200
    (2026-11-27), measured 5 steps into the next epoch, each NCCL epoch still held its set, and
    eight sets (35 MiB) were held at once after 8 quick changes. That transient is printed here
    and described in docs/operations.md; what this test bounds is what stays."""
    if backend == "nccl" and not torch.distributed.is_nccl_available():
        pytest.skip("needs a torch built with NCCL")
    gpus = 1 if backend == "nccl" else 0.5
    job = LocalJob(config(1, gpus, backend, steps=1_000_000, hidden=1024), ["w0"], str(tmp_path))
    replica = job.replicas["w0"]
    job.publish(("w0",), 1, 16, backend=backend)
    job.start(["w0"])
    transient, settled, release_s = [], [], []
    for epoch in range(2, 23):
        step = replica.training.step
        deadline = time.monotonic() + 60
        while replica.training.step < step + 5 or (replica.plan and replica.plan.membership_epoch != epoch - 1):
            assert time.monotonic() < deadline, f"no progress in epoch {epoch - 1}"
            time.sleep(0.01)
        torch.cuda.synchronize()
        transient.append(torch.cuda.memory_allocated())
        release_s.append(_released_groups())
        torch.cuda.synchronize()
        settled.append(torch.cuda.memory_allocated())
        job.publish(("w0",), epoch, 16, backend=backend)
    job.publish(("w0",), 23, 16, backend=backend, stop_step=replica.training.step + 5)
    job.wait(120)
    growth = settled[-1] - settled[0]
    gradients = sum(p.numel() * p.element_size() for p in replica.training.model.parameters())
    held = max(t - s for t, s in zip(transient, settled))
    print(f"{backend}: GPU memory allocated after epoch 1 {settled[0] / 2**20:.2f} MiB, after epoch 21 "
          f"{settled[-1] / 2**20:.2f} MiB (growth {growth / 2**10:.1f} KiB over 20 membership changes; one set "
          f"of gradients {gradients / 2**10:.0f} KiB); 5 steps into an epoch, before the last one's group "
          f"was released, up to {held / 2**10:.0f} KiB more ({held / gradients:.2f} sets); releases took up "
          f"to {max(release_s):.3f}s after that")
    assert growth < gradients, settled


@needs_nccl
def test_every_nccl_operation_at_world_size_1():
    host, port = local_store()
    comm = make_communicator(GroupSpec(host, port, "ops", 0, 1, 10.0, "nccl", "127.0.0.1"))
    x = torch.arange(6, dtype=torch.float32, device="cuda")
    comm.all_reduce(x).wait()
    comm.broadcast(x, 0).wait()
    out = [torch.empty_like(x)]
    comm.all_gather(out, x).wait()
    a2a = torch.empty_like(x)
    comm.all_to_all(a2a, x).wait()
    comm.barrier().wait()
    assert torch.equal(out[0], x) and torch.equal(a2a, x) and comm.bytes_sent > 0
    with pytest.raises(Exception) as err:  # bf16 either has a native NCCL type or raises; never silent fp16
        y = torch.ones(4, dtype=torch.bfloat16, device="cuda")
        comm.all_reduce(y).wait()
        assert float(y[0]) == 1.0
        raise RuntimeError("bf16 reduced natively")
    print(f"bf16: {err.value}")
    comm.close()


def _pair(name: str, timeout_s: float) -> list:
    """Both ranks of a gloo group, formed in threads of this process."""
    host, port = local_store()
    specs = [GroupSpec(host, port, name, r, 2, timeout_s, "gloo", "127.0.0.1") for r in range(2)]
    comms: list = [None, None]
    threads = [threading.Thread(target=lambda r=r: comms.__setitem__(r, make_communicator(specs[r]))) for r in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return comms


def test_abort_and_timeout_of_a_cuda_collective():
    """Gloo with CUDA tensors; in each group rank 1 never enters the all-reduce rank 0 waits in. Rank 1
    is kept alive (an H200 run of 2026-11-27 let it be collected: its group closed its connections
    and rank 0's wait failed on "Connection closed by peer" before the abort)."""
    aborted, _quiet = _pair("abort", 3.0)
    handle = aborted.all_reduce(torch.ones(1 << 20, device="cuda"))
    threading.Timer(0.2, lambda: aborted.abort("peer is silent")).start()
    started = time.monotonic()
    with pytest.raises(CommAborted):
        handle.wait()
    took = time.monotonic() - started - 0.2
    silent, _silent_peer = _pair("timeout", 3.0)
    started = time.monotonic()
    with pytest.raises(CommTimeout):
        silent.all_reduce(torch.ones(1 << 20, device="cuda")).wait()
    waited = time.monotonic() - started
    print(f"CUDA collective: released {took:.3f}s after the abort; without one, timed out after {waited:.2f}s")
    assert took < 1.0 and 2.5 < waited < 6.0


@needs_nccl
def test_nccl_group_whose_peer_never_arrives_times_out():
    """Rank 1 of a two-rank NCCL group never arrives: forming gives up after comm.timeout_s, or, where
    the non-blocking communicator returns before its peers are in, the first all-reduce does."""
    from actors.training.epoch_group import form_group

    host, port = local_store()
    started = time.monotonic()
    with pytest.raises(CommTimeout):
        comm = form_group(GroupSpec(host, port, "lonely", 0, 2, 3.0, "nccl", "127.0.0.1"), superseded=lambda: False)
        comm.all_reduce(torch.ones(4, device="cuda")).wait()
    took = time.monotonic() - started
    print(f"NCCL peer never arrived: CommTimeout after {took:.2f}s")
    assert took < 3.0 + 10.0


@needs_nccl
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_ray_util_collective_allreduce_on_an_nccl_epoch_group(ray_session, device):
    """A workload's `ray.util.collective.allreduce` of a CUDA tensor, or of a CPU tensor (copied to the GPU
    and back: NCCL takes device tensors only), on its epoch's NCCL group (world size 1 on one GPU), inside
    a real actor as a workload runs."""
    import ray

    from testkit.harness import CommPeer, StoreHost

    store = StoreHost.remote(10.0)
    host, port, _ = ray.get(store.address.remote())
    peer = CommPeer.options(num_gpus=1).remote()
    ray.get(peer.form.remote(GroupSpec(host, port, "raycol-nccl/e1", 0, 1, 10.0, "nccl", host)), timeout=60)
    ray.get(peer.start_all_reduce.remote(1 << 20, via_ray=True, device=device))
    result = ray.get(peer.wait_pending.remote(), timeout=60)
    print(f"ray.util.collective on NCCL, a {device} tensor: {result}")
    assert result["outcome"] == "ok" and result["value"] == 1.0
    ray.kill(peer)
    ray.kill(store)


@pytest.mark.gpu2
@needs_two
def test_bsp_over_nccl_with_two_gpus(tmp_path):
    """The two ranks run as threads of this process, each on its own GPU (testkit/in_process.py gives
    each replica a device; its thread and its group's formation thread use it)."""
    job = run_local(tmp_path, 2, 1, "nccl")
    assert {next(job.replicas[s].training.model.parameters()).device.index for s in ("w0", "w1")} == {0, 1}
    diff = max(float((p.cpu() - q).abs().max()) for p, q in zip(job.parameters("w0"), cpu_reference(32)))
    assert diff < 1e-5


def test_kill_and_join_of_gpu_workers(run_root):
    """Real actors sharing the GPU (0.3 each, gloo): a kill inside an all-reduce, the replacement joins."""
    from orchestrator.config import config_from_dict
    from orchestrator.job import ElasticJob

    cfg = config(2, 0.3, "gloo", steps=400)
    cfg["workers"].update(max=3)
    cfg["faults"] = {"kills": [{"slot": "w1", "step": 20, "at": "allreduce"}],
                     "stragglers": [{"slot": "w0", "delay_s": 0.05}]}
    job = ElasticJob(config_from_dict(cfg)).start()
    result = job.wait(timeout=300)
    reshapes = [e for e in job.events() if e["kind"] == "reshape"]
    print(f"GPU workers: {result.state} at {result.step}; reshapes {[e['detail']['detector'] for e in reshapes]}")
    assert result.state == "FINISHED" and result.step == 400
    assert any(e["detail"]["joiners"] == ["w1"] for e in reshapes), "the replacement must join"
    assert [r["step"] for r in job.history()] == list(range(1, 401))


def test_the_loader_on_a_gpu_copies_on_its_own_stream_and_trains_what_the_step_would(tmp_path):
    """Background loading on CUDA (actors/training/batch_feed.py `_chunks`): batches built ahead are pinned and
    copied on the loader's stream; the step waits for each copy's event. Two workers share the GPU over
    gloo; with the loader on, the ledger and the parameters are those of the run with it off."""
    runs = {}
    for name, loader in (("off", None), ("on", {"workers": 2, "prefetch": 2})):
        cfg = config(2, 0.5, "gloo", steps=40)
        cfg["faults"] = {"record_samples": True}
        if loader:
            cfg["workload"]["loader"] = loader
        job = LocalJob(cfg, ["w0", "w1"], str(tmp_path / name))
        job.run(("w0", "w1"), 32, backend="gloo")
        replica = job.replicas["w0"]
        runs[name] = ((tmp_path / name / "samples" / "w0.txt").read_text(), job.parameters("w0"),
                      replica.feed._copy_stream, replica.feed._loader)
    assert runs["on"][0] == runs["off"][0], "another sample order or split"
    diff = max(float((p - q).abs().max()) for p, q in zip(runs["on"][1], runs["off"][1]))
    stream, loader = runs["on"][2], runs["on"][3]
    print(f"loader on CUDA: {loader.taken} batches taken ahead, {loader.missed} built on the step; max diff {diff:.2e}")
    assert stream is not None and runs["off"][2] is None and loader.taken >= 30
    assert diff <= 1e-6


def test_the_state_digest_on_a_gpu_is_the_cpu_digest_and_reads_back_8_bytes():
    """The epoch entry's digest is computed on the device (actors/training/training_state.py): the same
    value as for the host copy, with no copy of the tensors to the host (only the int64 result)."""
    from actors.training.training_state import checksum

    g = torch.Generator().manual_seed(0)
    host = [torch.randn(3_000_001, generator=g), torch.randn(17, generator=g).to(torch.bfloat16)]
    device = [t.cuda() for t in host]
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        on_device = checksum(device)
    assert on_device == checksum(host)
    copies = [e for e in prof.events() if "Memcpy DtoH" in e.name]
    assert len(copies) == 1, [e.name for e in copies]


def test_the_votes_counts_reach_the_gpu_from_pinned_memory():
    """The vote's tail on a GPU (algorithms/policies/base.py `VoteDraft.tail`): its two counts are copied
    up from pinned memory without blocking, never from pageable memory (which makes the host wait for
    the GPU's queued work: a host sync every step)."""
    from algorithms.policies.base import VoteDraft

    loss = torch.tensor(2.5, device="cuda")
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        tail = VoteDraft(loss=loss, samples=32, newer_plan=True).tail(torch.float32, loss.device)
        torch.cuda.synchronize()
    assert tail.tolist() == [2.5, 32.0, 1.0]
    copies = [e.name for e in prof.events() if "Memcpy HtoD" in e.name]
    assert copies and all("Pinned" in name for name in copies), copies


def test_a_checkpoints_host_copy_of_gpu_state_is_pinned_and_taken_without_a_host_wait():
    """actors/training/checkpoint_writer.py `host_copy`: a GPU's tensors go into pinned host buffers on
    a side stream after the current stream's work, and the current stream's next write waits for them:
    the values are the ones at the copy, though the live tensor is changed right after."""
    from actors.training.checkpoint_writer import host_copy

    live = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    expected = live.cpu()
    copied, done = host_copy({"model": {"w": live}, "step": 3})
    live.add_(1.0)  # on the current stream, which waits for the copy first
    assert done is not None
    done.synchronize()
    assert copied["model"]["w"].is_pinned() and torch.equal(copied["model"]["w"], expected)


def test_a_hot_spare_on_a_gpu_holds_the_model_there_before_its_adoption():
    """actors/training/worker.py `prepare_spare`: a spare's CUDA context, its model on the device and
    cuBLAS's set-up are paid before it is adopted (its replica's `model.to(device)` then moves nothing)."""
    from actors.training.worker import prepare_spare
    from core.schema import JobConfig, parse

    cfg = parse(JobConfig, config(1, 1, "nccl"))
    workload = prepare_spare(cfg)
    assert all(p.is_cuda for p in workload.model.parameters())
    assert torch.cuda.is_initialized()
