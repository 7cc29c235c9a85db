"""The policies `plan` weighs: each candidate's label, its `sync:` and `compression:` sections and the
runtime model's view of it (algorithms/rules/runtime_model.py `PolicySpec`), and the job's config with one of
them in place."""
from __future__ import annotations

import copy
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
    hierarchical ones where the ranks span more than one node), in the table's order. The server kinds
    weigh none: their pushes and pulls travel on Ray's own transport, which the lab does not shape, so
    the model would compare them on other terms. `nodes`: the nodes the ranks were measured on (a probe
    of the user's cluster), else the lab's."""
    nodes = cfg.network.nodes if nodes is None else nodes
    applies = {"always": True, "multi_node": nodes > 1, "adamw": cfg.optimizer.name == "adamw",
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
                      bucket_bytes=bucket_bytes if name == "bsp" and not hierarchical else INF)


def with_candidate(cfg: JobConfig, cand: Candidate) -> JobConfig:
    """The job's config with the candidate's `sync:` and codec."""
    raw = cfg.to_dict()
    raw["sync"] = copy.deepcopy(cand.sync)
    raw["compression"] = {**raw["compression"], "codec": cand.compression.get("codec", "none")}
    return parse(JobConfig, raw)
