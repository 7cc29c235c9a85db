"""A transformer's training step four ways on the same model, settings and device: a plain single-process
torch loop, torch DDP, the orchestrator's BSP job, and each worker alone with no collective.

- **plain**: one process, the global batch, a loop written as nanoGPT's train loop writes it (the forward
  under autocast in the mixed precisions, `GradScaler` for fp16, `clip_grad_norm_(1.0)`, AdamW with
  nanoGPT's groups: weights of two or more dimensions decay, the rest not; fused on CUDA, torch's default
  on a CPU). On a CPU it runs as many torch threads as the others have workers (the same cores).
- **ddp**: that loop under `DistributedDataParallel`, one rank a worker, each the per-worker batch (gloo
  on a CPU; on one GPU NCCL holds one rank, so DDP runs at world size 1 there, and says so).
- **orchestrator**: the project's BSP job through Ray (2 workers of one CPU thread on a CPU, 1 worker on
  a GPU), with `training.precision` and `optimizer.clip_grad_norm: 1.0`, the same factory and optimizer
  settings (AdamW lr 6e-4, betas 0.9/0.95, weight decay 0.1; its own no-decay groups and kernels).
- **compute-only**: the plain loop in every worker's process at once, each on its per-worker batch with
  one thread, nothing exchanged; the orchestrator's step over the slowest of them is what orchestration
  costs. At one worker it is the plain loop itself, and is not run twice.

The same global-batch sampler deals every side its rows (testkit/ddp_pair.py's). Models: `tiny` and
`small` (the built-in byte-level GPT on the standard library's text), `gpt2-small` (a Hugging Face GPT-2:
12 layers, 768 wide, 12 heads, 1024 positions, a vocabulary of 50,257, random initialization, no dropout;
trained on the same byte text, ids 0-255 of its vocabulary, which does not change a step's cost, or on a
`--data-dir` that `python -m orchestrator prepare` wrote; without `transformers` installed, the built-in
GPT at that shape, said in the output).

Timing, per side: the end of each optimizer step on rank 0 (a CUDA synchronize first), after `--warmup`
steps; a step is the median interval between step ends (the orchestrator's: between its history records'
commit times), its compute time the median of forward, backward, clipping and update (the
orchestrator's: the record's step time less its waits on others; DDP's includes the all-reduce its hooks
overlap with the backward). Tokens/s: the global batch's predicted tokens over the step (wall clock,
goodput) and over the compute time. MFU: tokens/s x FLOPs per token (orchestrator/workloads/flops.py)
over the device's dense peak (`ORCHESTRATOR_PEAK_FLOPS` overrides); a CPU has no peak, so there the
figure is against a measured one-thread matmul rate per worker, and labelled so. Sides run in fresh
processes (one per rank), in an order that rotates every pair; ratios are taken pair by pair and their
medians reported (DDP's step over compute-only's too: what synchronizing costs torch itself); pairs
stop early when the next would overrun `--budget-s`. Every side has a time limit, and a side that fails
or overruns is reported with its error, not waited for.

    python benchmarks/lm_step.py [--device cpu|cuda] [--model tiny|small|gpt2-small] [--steps N] [--pairs K]
        [--precision fp32|bf16-mixed|fp16-mixed|bf16] [--batch B] [--data-dir DIR] [--budget-s S]
        [--set KEY=VALUE ...] [--niceness ray|0]

Prints a table, then one JSON line. Figures are measurements, not gates.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from actors.observe.peaks import peak_flops  # noqa: E402
from algorithms.policies.precision import AUTOCAST  # noqa: E402
from algorithms.rules.sampler import GlobalSampler, split_for_rank  # noqa: E402
from orchestrator.workloads import flops  # noqa: E402
from testkit.ddp_pair import BUCKET_MB, SEED, log  # noqa: E402
from testkit.peers import ddp_store, peer_workload  # noqa: E402
from testkit.processes import child_env  # noqa: E402

SIDES = ("plain", "compute", "ddp", "orchestrator")
WEIGHT_DECAY = 0.1
OPTIMIZER = {"name": "adamw", "lr": 6e-4, "betas": [0.9, 0.95], "weight_decay": WEIGHT_DECAY}
CLIP = 1.0
GPT2_SMALL = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024,
              "vocab_size": 50257, "seq_len": 1024, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
DEFAULTS = {  # per model: (per-worker batch, steps) on a CPU and on a GPU
    "tiny": {"cpu": (8, 100), "cuda": (64, 60)},
    "small": {"cpu": (2, 16), "cuda": (32, 40)},
    "gpt2-small": {"cpu": (1, 6), "cuda": (8, 30)},
}


def workload_spec(model: str, data_dir: str | None) -> tuple[dict, str]:
    """(the factory and parameters every side builds, a line naming what was built)."""
    if model in ("tiny", "small"):
        return {"factory": "orchestrator.workloads.lm:gpt", "params": {"size": model}}, f"built-in GPT {model}"
    try:
        import transformers  # noqa: F401 - only whether it is installed
    except ImportError:
        if data_dir:
            raise SystemExit("lm_step: --data-dir needs transformers (pip install -e '.[hf]')") from None
        params = {"size": "small", "d_model": 768, "n_layer": 12, "n_head": 12, "seq_len": 1024, "vocab": 50257}
        return ({"factory": "orchestrator.workloads.lm:gpt", "params": params},
                "built-in GPT at GPT-2-small's shape (transformers is not installed)")
    params = dict(GPT2_SMALL, **({"data_dir": data_dir} if data_dir else {}))
    return {"factory": "orchestrator.workloads.hf:causal_lm", "params": params}, "Hugging Face GPT-2 small"


# --------------------------------------------------------------------------- the plain loop, in each side's processes
def _fetch(data, ids) -> Any:
    """The rows for `ids`: gathered from a tensor dataset as a user writes it, else item by item."""
    if hasattr(data, "tensors"):
        return tuple(t[torch.as_tensor(ids)] for t in data.tensors)
    return torch.utils.data.default_collate([data[int(i)] for i in ids])


def _nanogpt_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def _side(rank: int, mode: str, setup: dict, out_dir: str) -> None:
    """One process of a side (`plain`, `compute` or `ddp`): the loop, timed; writes rank{rank}.json."""
    if setup["niceness"]:
        os.nice(setup["niceness"])
    device = torch.device(setup["device"])
    workers, per_worker = setup["workers"], setup["batch"]
    torch.set_num_threads(workers if mode == "plain" and device.type == "cpu" else 1)
    model: torch.nn.Module
    if mode == "ddp":
        import torch.distributed as dist

        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=ddp_store(rank, out_dir, workers),
                                rank=rank, world_size=workers, timeout=datetime.timedelta(seconds=120))
    spec = dict(setup["spec"], optimizer=OPTIMIZER)
    workload, make_opt = peer_workload(spec, SEED, **({"fused": True} if device.type == "cuda" else {}))
    model = workload.model.to(device)
    if setup["precision"] == "bf16":
        model = model.to(torch.bfloat16)
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB, device_ids=[device.index or 0] if device.type == "cuda" else None)
    opt = make_opt(_nanogpt_groups(model, WEIGHT_DECAY))
    autocast = AUTOCAST.get(setup["precision"])
    scaler = torch.amp.GradScaler(device.type, enabled=setup["precision"] == "fp16-mixed")
    data = workload.train_data
    sampler = GlobalSampler(len(data), SEED)
    global_batch = per_worker * workers
    ends, compute = [], []
    for step in range(setup["steps"]):
        ids = sampler.global_batch(step * global_batch, global_batch)
        batch = _fetch(data, ids if mode == "plain" else split_for_rank(ids, rank, workers))
        started = time.perf_counter()
        context = torch.autocast(device.type, dtype=autocast) if autocast else contextlib.nullcontext()
        with context:
            loss = workload.loss(model, batch)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ends.append(time.perf_counter())
        compute.append(ends[-1] - started)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"ends": ends, "compute": compute}))
    if mode == "ddp":
        import torch.distributed as dist

        dist.barrier()  # rank 0 serves the store: it leaves last
        dist.destroy_process_group()


def _timed(ends: list[float], compute: list[float], warmup: int) -> dict:
    """Median step (between step ends) and median compute time over the steps after `warmup`."""
    steps = [b - a for a, b in zip(ends[warmup:], ends[warmup + 1:])]
    if not steps:
        raise RuntimeError(f"no step after the {warmup} warm-up steps to time: raise --steps")
    return {"step_s": statistics.median(steps), "compute_s": statistics.median(compute[warmup + 1:])}


def run_processes(mode: str, setup: dict, timeout: float) -> dict:
    """A side in fresh processes (one per rank), killed after `timeout` seconds."""
    nprocs = 1 if mode == "plain" else setup["workers"]
    with tempfile.TemporaryDirectory() as out:
        context = mp.start_processes(_side, args=(mode, setup, out), nprocs=nprocs, join=False)
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{mode}: still running after {timeout:.0f}s (--side-timeout-s)")
        except mp.ProcessExitedException as err:  # torch's teardown can abort after the timed loop
            if not all(Path(out, f"rank{r}.json").exists() for r in range(nprocs)):
                raise
            log(f"{mode}: a rank exited badly after writing its timings ({err}); the timings stand")
        finally:
            for proc in context.processes:
                if proc.is_alive():
                    proc.kill()
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(nprocs)]
    timed = [_timed(r["ends"], r["compute"], setup["warmup"]) for r in ranks]
    if mode == "compute":  # a collective would wait for the slowest worker
        return max(timed, key=lambda t: t["step_s"])
    return timed[0]


# --------------------------------------------------------------------------- the orchestrator's side
def job_config(name: str, setup: dict):
    from orchestrator.config import config_from_dict

    cuda = setup["device"] == "cuda"
    return config_from_dict({
        "name": name, "seed": SEED,
        "workers": {"count": setup["workers"], "cpus": 1, **({"gpus": 1} if cuda else {})},
        "workload": {**setup["spec"], "batch_size": setup["batch"]},
        "optimizer": {**OPTIMIZER, "clip_grad_norm": CLIP},
        "training": {"precision": setup["precision"]},
        "sync": {"policy": "bsp", "bucket_mb": BUCKET_MB}, **({"comm": {"backend": "nccl"}} if cuda else {}),
        "stop": {"max_steps": setup["steps"]}, "eval_every": 0,
    }, setup["overrides"])


def run_orchestrator(name: str, setup: dict, timeout: float) -> dict:
    """The BSP job on the Ray this process is connected to: steps from its history records' commit times,
    compute as each record's step time less its waits."""
    from orchestrator.job import ElasticJob

    job = ElasticJob(job_config(name, setup)).start()
    try:
        result = job.wait(timeout=timeout)
    except TimeoutError:
        job.stop(reason="lm_step: side timed out", timeout=30)
        raise TimeoutError(f"orchestrator: still running after {timeout:.0f}s (--side-timeout-s)") from None
    if result.state != "FINISHED":
        raise RuntimeError(f"orchestrator run {name} ended {result.state}: {result.cause}")
    records = sorted(job.history(), key=lambda r: r["step"])
    return _timed([r["time"] for r in records], [r["step_time"] - r["wait_s"] for r in records], setup["warmup"])


# --------------------------------------------------------------------------- figures
def side_figures(timed: dict, tokens_per_step: int, fpt: float | None, peak: float | None, devices: int) -> dict:
    out = dict(timed, tokens_per_s_wall=tokens_per_step / timed["step_s"],
               tokens_per_s_compute=tokens_per_step / timed["compute_s"])
    if fpt is not None and peak is not None:
        out["mfu"] = flops.mfu(out["tokens_per_s_wall"], fpt, peak, devices)
    return out


def median_of(pairs: list[dict], key) -> float | None:
    values = [v for v in (key(p) for p in pairs) if v is not None]
    return statistics.median(values) if values else None


def _ratio(pair: dict, a: str, b: str, field: str) -> float | None:
    x, y = pair.get(a, {}), pair.get(b, {})
    return x[field] / y[field] if field in x and field in y else None


def run_side(side: str, i: int, setup: dict, timeout: float) -> dict:
    try:
        if side == "orchestrator":
            return run_orchestrator(f"lm-step-{os.getpid()}-{i}", setup, timeout)
        return run_processes(side, setup, timeout)
    except Exception as err:  # noqa: BLE001 - a side that fails is reported, the others still run
        text = str(err).strip().splitlines()
        return {"error": f"{type(err).__name__}: {text[-1] if text else ''}"[:400]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--model", choices=sorted(DEFAULTS), default="tiny")
    parser.add_argument("--steps", type=int, help="steps a side trains (default: per model and device)")
    parser.add_argument("--warmup", type=int, help="steps left out of the timing (default: a third of --steps)")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--precision", choices=["fp32", "bf16-mixed", "fp16-mixed", "bf16"],
                        help="default: bf16-mixed on a GPU, fp32 on a CPU")
    parser.add_argument("--batch", type=int, help="per-worker batch (default: per model and device)")
    parser.add_argument("--data-dir", help="a folder `python -m orchestrator prepare` wrote (gpt2-small only)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no pair that would end past this many seconds (default: 110 on a GPU, 240 on a CPU)")
    parser.add_argument("--side-timeout-s", type=float, default=None, help="each side's limit (default: 90 GPU, 300 CPU)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for the orchestrator's job (repeatable), e.g. sync.engine=python")
    parser.add_argument("--niceness", choices=["ray", "0"], default="ray",
                        help="the plain, DDP and compute-only processes at the niceness Ray gives its workers, or at 0")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("lm_step: --device cuda, but torch sees no GPU", file=sys.stderr)
        return 2
    if args.data_dir and args.model != "gpt2-small":
        print("lm_step: --data-dir is for --model gpt2-small (the built-in GPT reads its own byte text)", file=sys.stderr)
        return 2
    batch, steps = DEFAULTS[args.model][args.device]
    steps = args.steps or steps
    warmup = args.warmup if args.warmup is not None else max(1, steps // 3)
    if steps - warmup < 3:
        print(f"lm_step: --steps {steps} leaves fewer than 3 timed steps after {warmup} warm-up steps", file=sys.stderr)
        return 2
    precision = args.precision or ("bf16-mixed" if cuda else "fp32")
    spec, built = workload_spec(args.model, args.data_dir)
    workers = 1 if cuda else 2
    budget = args.budget_s or (110.0 if cuda else 240.0)
    side_timeout = args.side_timeout_s or (90.0 if cuda else 300.0)
    started = time.monotonic()

    from core.factory import check_factory

    torch.manual_seed(SEED)
    probe = check_factory(spec["factory"])(**spec["params"])
    seq_len = int(probe.tokens_per_sample)
    fpt = flops.flops_per_token(probe.model, seq_len)
    n_params = sum(p.numel() for p in probe.model.parameters())
    del probe
    compute_dtype = AUTOCAST.get(precision) or (torch.bfloat16 if precision == "bf16" else torch.float32)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    peak, peak_source = peak_flops(device, compute_dtype)
    versus = "peak"
    if peak is None:  # what one worker's thread (or the GPU) reaches on a matmul: achievable, not a peak
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        peak = flops.measured_matmul_flops(device, compute_dtype)
        torch.set_num_threads(threads)
        versus = "measured matmul"
        peak_source = f"measured {str(compute_dtype).removeprefix('torch.')} matmul, 1 thread: {peak / 1e9:.1f} GFLOP/s " \
                      f"({peak_source})"
    log(f"{built}: {n_params / 1e6:.2f}M parameters, seq {seq_len}, {fpt and fpt / 1e6:.1f} MFLOP/token; "
        f"{precision}; {workers} worker(s), per-worker batch {args.batch or batch}; MFU vs {versus}: {peak_source}")

    import ray

    from orchestrator.job import NAMESPACE, ensure_token_env

    os.environ["PYTHONPATH"] = child_env(REPO)["PYTHONPATH"]  # Ray's workers run this checkout
    os.environ.setdefault("ORCHESTRATOR_RUN_ROOT", tempfile.mkdtemp(prefix="lm-step-runs-"))
    ensure_token_env()
    ray.init(address="local", num_cpus=8, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.ERROR)
    niceness = ray.get(ray.remote(num_cpus=0)(lambda: os.nice(0)).remote()) if args.niceness == "ray" else 0
    setup = {"device": args.device, "spec": spec, "workers": workers, "batch": args.batch or batch, "steps": steps,
             "warmup": warmup, "precision": precision, "niceness": niceness,
             "overrides": args.set}
    tokens_per_step = setup["batch"] * workers * seq_len
    devices = 1 if cuda else workers  # a CPU side uses `workers` cores (plain: as many threads)

    pairs: list[dict] = []
    pair_s = 0.0
    for i in range(args.pairs):
        if pairs and time.monotonic() - started + pair_s > budget:
            log(f"stopping after {len(pairs)} pair(s): another would overrun --budget-s {budget:.0f}")
            break
        began = time.monotonic()
        order = SIDES[i % len(SIDES):] + SIDES[:i % len(SIDES)]
        pair: dict[str, dict] = {}
        for side in order:
            if side == "compute" and workers == 1:
                continue  # one worker alone is the plain loop
            timed = run_side(side, i, setup, side_timeout)
            pair[side] = timed if "error" in timed else side_figures(timed, tokens_per_step, fpt, peak, devices)
            log(f"pair {i + 1} {side}: " + (pair[side]["error"] if "error" in pair[side] else
                f"step {pair[side]['step_s'] * 1e3:.1f} ms, {pair[side]['tokens_per_s_wall']:.0f} tokens/s"))
        if workers == 1:
            pair["compute"] = pair["plain"]
        pair["ratios"] = {"tokens_per_s_orchestrator_vs_ddp": _ratio(pair, "orchestrator", "ddp", "tokens_per_s_wall"),
                          "step_orchestrator_vs_compute_only": _ratio(pair, "orchestrator", "compute", "step_s"),
                          "step_orchestrator_vs_plain": _ratio(pair, "orchestrator", "plain", "step_s"),
                          "step_ddp_vs_compute_only": _ratio(pair, "ddp", "compute", "step_s")}
        pairs.append(pair)
        pair_s = time.monotonic() - began
    ray.shutdown()

    fields = ("step_s", "compute_s", "tokens_per_s_compute", "tokens_per_s_wall", "mfu")
    sides = {side: {f: median_of(pairs, lambda p, s=side, f=f: p[s].get(f)) for f in fields} for side in SIDES}
    errors = {side: [p[side]["error"] for p in pairs if "error" in p[side]] for side in SIDES}
    ratios = {k: median_of(pairs, lambda p, k=k: p["ratios"][k]) for k in pairs[0]["ratios"]}
    mfu_label = "MFU" if versus == "peak" else "MFU vs measured matmul"
    print(f"{'side':<14}{'step ms':>10}{'compute ms':>12}{'tok/s compute':>15}{'tok/s wall':>12}{mfu_label:>24}")
    for side in SIDES:
        s = sides[side]
        if s["step_s"] is None:
            print(f"{side:<14}failed: {errors[side][0] if errors[side] else 'n/a'}")
            continue
        step, spent, by_compute, by_wall = (float(s[f] or 0.0) for f in fields[:4])  # a side that ran has them all
        share = s["mfu"]
        mfu_text = f"{share * 100:.1f}%" if share is not None else "n/a"
        print(f"{side:<14}{step * 1e3:>10.1f}{spent * 1e3:>12.1f}{by_compute:>15.0f}{by_wall:>12.0f}{mfu_text:>24}")
    for key, value in ratios.items():
        print(f"{key:<40}{(f'{value:.3f}' if value is not None else 'n/a'):>10}")
    notes = [] if workers > 1 else ["one GPU: DDP at world size 1 (NCCL holds one rank per GPU); compute-only is the plain loop"]
    print(json.dumps({
        "benchmark": "lm_step", "device": args.device, "device_name": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__, "model": args.model, "built": built, "params": n_params, "seq_len": seq_len,
        "flops_per_token": fpt, "precision": precision, "workers": workers, "per_worker_batch": setup["batch"],
        "tokens_per_step": tokens_per_step, "steps": steps, "warmup": warmup, "pairs": len(pairs), "niceness": niceness,
        "overrides": args.set, "peak_flops": peak, "mfu_vs": versus, "peak_source": peak_source, "notes": notes,
        "ratios": ratios, "sides": sides, "errors": {k: v for k, v in errors.items() if v}, "per_pair": pairs}))
    return 1 if any(sides[s]["step_s"] is None for s in SIDES) else 0


if __name__ == "__main__":
    sys.exit(main())
