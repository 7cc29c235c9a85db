"""The policies `plan` weighs: each candidate's label, its `sync:` and `compression:` sections and the
runtime model's view of it (algorithms/rules/runtime_model.py `PolicySpec`), and the job's config with one of
them in place."""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from algorithms.rules.runtime_model import CODEC_RATIO, INF, PolicySpec
from core.schema import POLICIES, JobConfig, Weighed, parse


@dataclass(frozen=True)
class Candidate:
    """One policy as `plan` weighs it: a label, its `sync:`/`compression:` sections, the model's view."""

    label: str
    sync: dict[str, object]
    compression: dict[str, str]
    spec: PolicySpec


def candidates(cfg: JobConfig, nodes: int | None = None) -> list[Candidate]:
    """The policies this job could run with: each row of the policy table's `weighed` configurations
    that applies to it (the Adam-based ones with an AdamW optimizer, their SGD counterparts otherwise;
    hierarchical ones where the ranks span more than one node on gloo), in the table's order. The server kinds
    weigh none: their pushes and pulls travel on Ray's own transport, which the lab does not shape, so
    the model would compare them on other terms. `nodes`: the nodes the ranks were measured on (a probe
    of the user's cluster), else the lab's."""
    nodes = cfg.network.nodes if nodes is None else nodes
    # hierarchical variants where the ranks span nodes, over gloo only (refused on NCCL: core/schema/job.py)
    applies = {"always": True, "multi_node": nodes > 1 and cfg.group_backend == "gloo", "adamw": cfg.optimizer.name == "adamw",
               "sgd": cfg.optimizer.name != "adamw"}
    bucket = getattr(cfg.sync, "bucket_mb", 25.0) * 2 ** 20  # the job's own bucket size where it sets one
    return [Candidate(w.label, {"policy": row.name, **copy.deepcopy(w.knobs)},
                      {"codec": w.codec} if w.codec != "none" else {}, spec_of(row.name, w, cfg, bucket))
            for row in POLICIES for w in row.weighed if applies[w.when]]


def spec_of(name: str, weighed: Weighed, cfg: JobConfig, bucket_bytes: float) -> PolicySpec:
    """The runtime model's view of one weighed configuration: its codec's wire ratio, its knobs, the
    job's bucket size (flat BSP's overlap with backward) and, for a warm-up, the job's steps."""
    def number(key: str, default: int) -> int:
        value = weighed.knobs.get(key, default)
        assert isinstance(value, int), f"{weighed.label}: {key} is {value!r}"
        return value
    hierarchical = weighed.knobs.get("hierarchical", False) is True
    return PolicySpec(name, codec_ratio=CODEC_RATIO[weighed.codec], codec=weighed.codec, hierarchical=hierarchical,
                      h=number("h", 1), fragments=number("fragments", 1), overlap=number("overlap", 0),
                      warmup_steps=number("warmup_steps", 0),
                      total_steps=(cfg.stop.max_steps or 0) if "warmup_steps" in weighed.knobs else 0,
                      bucket_bytes=bucket_bytes if name in BUCKETED else INF)


BUCKETED = ("bsp", "bytegrad")
"""The policies whose gradients travel in `sync.bucket_mb` buckets (algorithms/policies/allreduce.py)."""


def with_layout(cands: Sequence[Candidate], layout: Sequence[tuple[int, str]], lab: bool) -> list[Candidate]:
    """`cands` with each bucketed policy's buckets as the job makes them from the model's parameters
    (`layout`: each trainable parameter's element count and dtype, in the model's order): the Python
    bucket hooks' grouping where the reducer is not used (a codec, a hierarchical all-reduce, the lab's
    modelled latency), else torch's reducer's (algorithms/policies/allreduce.py)."""
    import torch  # only where a model's layout was measured

    from algorithms.policies.allreduce import TAIL, plan_buckets, plan_reducer_buckets

    sizes = [(numel, getattr(torch, dtype)) for numel, dtype in layout]
    itemsize = [torch.empty((), dtype=dtype).element_size() for _, dtype in sizes]
    out = []
    for cand in cands:
        spec = cand.spec
        if spec.name not in BUCKETED or spec.bucket_bytes >= INF or not sizes:
            out.append(cand)
            continue
        python_hooks = lab or spec.hierarchical or spec.codec != "none"
        if python_hooks:
            plan = plan_buckets(sizes, int(spec.bucket_bytes)).buckets
            parts = [float(sum(sizes[i][0] * itemsize[i] for i in b)) for b in plan]
        else:  # the reducer's buckets hold the vote's leaf first (a few bytes), then the parameters
            plan = plan_reducer_buckets([(TAIL, sizes[0][1]), *sizes], int(spec.bucket_bytes)).buckets
            parts = [float(sum(sizes[i - 1][0] * itemsize[i - 1] for i in b if i > 0)) for b in plan]
        out.append(dataclasses.replace(cand, spec=dataclasses.replace(spec, bucket_sizes=tuple(p for p in parts if p > 0))))
    return out


def with_candidate(cfg: JobConfig, cand: Candidate) -> JobConfig:
    """The job's config with the candidate's `sync:` and codec."""
    raw = cfg.to_dict()
    raw["sync"] = copy.deepcopy(cand.sync)
    raw["compression"] = {**raw["compression"], "codec": cand.compression.get("codec", "none")}
    return parse(JobConfig, raw)
