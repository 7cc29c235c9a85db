"""The policies `plan` weighs: each candidate's label, its `sync:` and `compression:` sections and the
runtime model's view of it (algorithms/rules/runtime_model.py `PolicySpec`), and the job's config with one of
them in place."""
from __future__ import annotations

import copy
from dataclasses import dataclass

from algorithms.rules.runtime_model import CODEC_RATIO, PolicySpec
from core.schema import JobConfig, parse


@dataclass(frozen=True)
class Candidate:
    """One policy as `plan` weighs it: a label, its `sync:`/`compression:` sections, the model's view."""

    label: str
    sync: dict[str, object]
    compression: dict[str, str]
    spec: PolicySpec


def candidates(cfg: JobConfig, nodes: int | None = None) -> list[Candidate]:
    """The policies this job could run with, each with the knobs the comparison uses. Adam-based ones
    (`qadam`, `dadam`) with an AdamW optimizer, the others with SGD; hierarchical BSP where the
    network has more than one node. The server kinds are left out: their pushes and pulls travel on
    Ray's own transport, which the lab does not shape, so the model would compare them on other terms.
    `nodes`: the nodes the ranks were measured on (a probe of the user's cluster), else the lab's."""
    adam = cfg.optimizer.name == "adamw"
    nodes = cfg.network.nodes if nodes is None else nodes
    ring = {"kind": "ring"}
    bucket = getattr(cfg.sync, "bucket_mb", 25.0) * 2 ** 20  # the job's own bucket size where it sets one
    out = [Candidate("bsp", {"policy": "bsp"}, {}, PolicySpec("bsp", bucket_bytes=bucket))]
    if nodes > 1:
        out.append(Candidate("bsp hierarchical", {"policy": "bsp", "hierarchical": True}, {},
                             PolicySpec("bsp", hierarchical=True)))
    out.append(Candidate("bytegrad uint8", {"policy": "bytegrad"}, {"codec": "uint8"},
                         PolicySpec("bytegrad", codec_ratio=CODEC_RATIO["uint8"], codec="uint8")))
    if nodes > 1:
        out.append(Candidate("bytegrad hierarchical uint8", {"policy": "bytegrad", "hierarchical": True},
                             {"codec": "uint8"},
                             PolicySpec("bytegrad", codec_ratio=CODEC_RATIO["uint8"], codec="uint8", hierarchical=True)))
    if adam:
        steps = cfg.stop.max_steps or 0
        out.append(Candidate("qadam uint8", {"policy": "qadam", "warmup_steps": 100}, {"codec": "uint8"},
                             PolicySpec("qadam", codec_ratio=CODEC_RATIO["uint8"], codec="uint8", warmup_steps=100,
                                        total_steps=steps)))
    out.append(Candidate("local_sgd h=8", {"policy": "local_sgd", "h": 8}, {}, PolicySpec("local_sgd", h=8)))
    out.append(Candidate("diloco h=16", {"policy": "diloco", "h": 16}, {}, PolicySpec("diloco", h=16)))
    out.append(Candidate("streaming_diloco h=16 f=4",
                         {"policy": "streaming_diloco", "h": 16, "fragments": 4, "overlap": 1}, {},
                         PolicySpec("streaming_diloco", h=16, fragments=4, overlap=1)))
    out.append(Candidate("dpsgd ring", {"policy": "dpsgd", "topology": ring}, {}, PolicySpec("dpsgd")))
    out.append(Candidate("dpsgd ring uint8", {"policy": "dpsgd", "topology": ring}, {"codec": "uint8"},
                         PolicySpec("dpsgd", codec_ratio=CODEC_RATIO["uint8"], codec="uint8")))
    if adam:
        out.append(Candidate("dadam ring k=4", {"policy": "dadam", "topology": ring, "k": 4}, {}, PolicySpec("dadam")))
    else:
        out.append(Candidate("choco ring uint8", {"policy": "choco", "topology": ring}, {"codec": "uint8"},
                             PolicySpec("choco", codec_ratio=CODEC_RATIO["uint8"], codec="uint8")))
    out.append(Candidate("shadow ma", {"policy": "shadow", "method": "ma"}, {}, PolicySpec("shadow")))
    return out


def with_candidate(cfg: JobConfig, cand: Candidate) -> JobConfig:
    """The job's config with the candidate's `sync:` and codec."""
    raw = cfg.to_dict()
    raw["sync"] = copy.deepcopy(cand.sync)
    raw["compression"] = {**raw["compression"], "codec": cand.compression.get("codec", "none")}
    return parse(JobConfig, raw)
