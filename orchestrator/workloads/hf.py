"""Any Hugging Face causal language model as a workload (the `hf` extra: `pip install -e '.[hf]'`).

    workload:
      factory: "orchestrator.workloads.hf:causal_lm"
      params: {model_type: gpt2, n_layer: 2, n_embd: 128, n_head: 4, seq_len: 64, data_dir: /data/my-text}

The model is built from a `transformers` configuration (`model_type` and its fields; random
initialization, nothing downloaded) or loaded from a local directory (`model_dir`, files only: a
pretrained model to fine-tune). The text is, in this order of preference:
- `data_dir`: a folder `python -m orchestrator prepare` wrote (token shards and a manifest naming the
  tokenizer and its vocabulary, which sizes the model's embedding; a pretrained model must embed it);
- `data: "module:function"`: a function returning `(train, eval)`, each a map-style dataset (or
  tensor) whose items are rows of `seq_len + 1` token ids, or Hugging Face dicts (`input_ids`,
  `attention_mask`, `labels` with -100 where no loss is taken: padding); `eval_count` items of eval;
- otherwise the built-in byte-level text (orchestrator/workloads/lm.py: the standard library's source,
  vocabulary 256).
`vocab_size` overrides the vocabulary (a model built from its configuration).

A window of `seq_len + 1` tokens feeds the model its first `seq_len` and predicts its last `seq_len`
(the labels are shifted once, here), so a model with `seq_len` positions fits. With dict samples
the loss is the mean over the global batch's loss tokens, exactly, for any world size and any split of
the tokens between members (`loss_tokens`); token rows all hold `seq_len` of them, so their samples
weigh alike. Evaluation: the mean loss over every loss token of `eval` (and its perplexity).

The workers' steps are seeded per (job seed, slot, step), so a configuration's dropout draws differ
between workers as they would under DDP; set the `*_pdrop` / `*_dropout` fields to 0 for runs that
must equal single-process training exactly. `dtype`: float32 or bfloat16 (or float64); for mixed
precision keep float32 and set `training.precision: bf16-mixed`. Tied weights (the output layer
sharing the input embedding) stay tied: the model's parameters are listed once, and a checkpoint's
state loads into a fresh model built the same way.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Subset, TensorDataset

from core.factory import check_factory
from orchestrator.workloads import MapData, MeanEvaluation, Workload
from orchestrator.workloads.flops import flops_per_token
from orchestrator.workloads.lm import VOCAB, eval_windows, text_arrays, windows

try:
    import transformers
except ImportError as err:  # one line, naming the extra (check_factory reports it at config time)
    raise ImportError(f"orchestrator.workloads.hf needs the transformers package ({err}): "
                      f"pip install -e '.[hf]'") from None


IGNORE = -100
"""The label of a position that takes no loss (padding): Hugging Face's convention, and cross-entropy's
`ignore_index`."""


def _rows(batch: Any) -> torch.Tensor:
    if isinstance(batch, (tuple, list)):
        batch = batch[0] if len(batch) == 1 else torch.stack([torch.as_tensor(b) for b in batch])
    return torch.as_tensor(batch)


def _inputs(model: torch.nn.Module, batch: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(the model's keyword inputs, the next-token targets) of a batch.

    A batch of token rows (each `seq_len + 1` tokens, a window of the text) is fed its first `seq_len`
    tokens and predicts the last `seq_len`: the labels are shifted once, here. A dict batch is Hugging
    Face's: `input_ids` with `attention_mask` and `labels` (each optional but `input_ids`; `labels`
    default to `input_ids` where the mask is set, and -100 where it is not), aligned with the inputs
    as Hugging Face aligns them: position t's logits predict label t + 1."""
    device = next(model.parameters()).device
    if isinstance(batch, dict):
        ids = torch.as_tensor(batch["input_ids"]).to(device=device, dtype=torch.long)
        mask = batch.get("attention_mask")
        inputs = {"input_ids": ids, **({"attention_mask": torch.as_tensor(mask).to(device)} if mask is not None else {})}
        return inputs, _labels(batch).to(device=device, dtype=torch.long)[:, 1:]
    rows = _rows(batch).to(device=device, dtype=torch.long)
    return {"input_ids": rows[:, :-1]}, rows[:, 1:]


def _labels(batch: dict) -> torch.Tensor:
    """A dict batch's labels, aligned with its `input_ids`: its own `labels`, else the ids with -100 where
    the attention mask is 0 (padding), else the ids."""
    labels = batch.get("labels")
    if labels is not None:
        return torch.as_tensor(labels)
    ids, mask = torch.as_tensor(batch["input_ids"]), batch.get("attention_mask")
    return ids if mask is None else ids.masked_fill(torch.as_tensor(mask) == 0, IGNORE)


def own_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The mean next-token cross-entropy over the batch's loss tokens (those not labelled -100), in
    float32 whatever the model's dtype."""
    inputs, targets = _inputs(model, batch)
    logits = model(**inputs).logits
    if isinstance(batch, dict):
        logits = logits[:, :-1]  # Hugging Face's alignment: the last position predicts nothing here
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE)


def loss_tokens(batch: Any) -> int:
    """How many tokens of `batch` take a loss: what each of its samples weighs in the step's mean (the
    replica weighs a member's loss by its share of the global batch's loss tokens)."""
    if isinstance(batch, dict):
        return int((_labels(batch)[:, 1:] != IGNORE).sum())
    rows = _rows(batch)
    return rows[:, 1:].numel()


def _loss_token_sums(model: torch.nn.Module, data: TensorDataset | MapData, batch: int = 32) -> dict[str, tuple[float, float]]:
    """The next-token loss summed over every loss token of `data` (token rows or Hugging Face dicts), in
    eval mode, and the number of those tokens."""
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(data), batch):
            chunk = _collate([data[i] for i in range(start, min(start + batch, len(data)))])
            n = loss_tokens(chunk)
            if n:
                total += float(own_loss(model, chunk)) * n
                tokens += n
    model.train(was_training)
    return {"eval_loss": (total, float(tokens))}


def _perplexity(means: dict[str, float]) -> dict[str, float]:
    return {"perplexity": math.exp(min(means["eval_loss"], 50.0))}


held_out_loss = MeanEvaluation(_loss_token_sums, _perplexity)
"""The mean next-token loss over every loss token of the held-out data, and its perplexity; split across
the members of a synchronous policy, token-weighted (core/workload_api.py `MeanEvaluation`)."""


def _collate(items: list[Any]) -> Any:
    if isinstance(items[0], dict):
        return {key: torch.stack([torch.as_tensor(item[key]) for item in items]) for key in items[0]}
    return torch.stack([_rows(item) for item in items])


def build_model(model_type: str | None, model_dir: str | None, vocab_size: int, fields: dict) -> torch.nn.Module:
    model = _build_model(model_type, model_dir, vocab_size, fields)
    if getattr(model, "loss_type", "") is None:  # a class name transformers does not map (GPT2LMHeadModel): its causal-LM loss
        # torch's stubs type Module.__setattr__ for tensors and modules only; any attribute is allowed
        model.loss_type = "ForCausalLM"  # type: ignore[assignment]
    return model


def _build_model(model_type: str | None, model_dir: str | None, vocab_size: int, fields: dict) -> torch.nn.Module:
    if model_dir:
        if model_type or fields:
            raise ValueError("workload hf: give model_dir, or model_type with its fields, not both")
        return transformers.AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    if not model_type:
        raise ValueError("workload hf: name a model_type (gpt2, llama, ...) or a local model_dir")
    fields = {"bos_token_id": None, "eos_token_id": None, **fields}  # the defaults may name ids past the vocabulary
    try:
        config = transformers.AutoConfig.for_model(model_type, vocab_size=vocab_size, **fields)
    except (ValueError, TypeError, KeyError) as err:
        raise ValueError(f"workload hf: model_type {model_type!r}: {str(err).splitlines()[0][:160]}") from None
    return transformers.AutoModelForCausalLM.from_config(config)


def causal_lm(model_type: str | None = None, model_dir: str | None = None, seq_len: int = 64, dtype: str = "float32",
              eval_count: int = 64, data: str | None = None, data_dir: str | None = None, vocab_size: int | None = None,
              **fields: Any) -> Workload:
    """A `transformers` causal LM (`model_type` with its configuration `fields`, or `model_dir`) on the
    built-in byte-level text, on a folder `prepare` wrote (`data_dir`), or on `data` (see the module's text)."""
    if dtype not in ("float32", "bfloat16", "float64"):
        raise ValueError(f"workload hf: dtype must be float32, bfloat16 or float64, got {dtype!r}")
    if data and data_dir:
        raise ValueError("workload hf: give data (a function returning datasets) or data_dir (a folder prepare wrote), not both")
    if model_dir and not (data or data_dir):
        raise ValueError("workload hf: a pretrained model_dir trains on its own tokenizer's ids: name data_dir (a folder "
                         "`python -m orchestrator prepare --tokenizer MODEL_DIR` wrote) or data")
    manifest = None
    if data_dir:
        from orchestrator.data.manifest import read_manifest

        manifest = read_manifest(data_dir)
    vocab = vocab_size or (manifest.vocab_size if manifest is not None else None)
    model = build_model(model_type, model_dir, vocab or VOCAB, fields)
    _check_fits(model, vocab, seq_len)
    model.to(getattr(torch, dtype))
    tokens: Any = None
    if manifest is not None:
        from orchestrator.data.shards import TokenShards

        train_data: Any = TokenShards(str(manifest.train), seq_len, manifest.dtype, vocab=manifest.vocab_size)
        held = TokenShards(str(manifest.eval), seq_len, manifest.dtype, vocab=manifest.vocab_size) if manifest.eval else None
        eval_data: Any = None if held is None else Subset(held, range(min(eval_count, len(held))))
    elif data:
        train_data, eval_data = check_factory(data)()
        if isinstance(train_data, torch.Tensor):
            train_data = TensorDataset(train_data)
        if isinstance(eval_data, torch.Tensor):
            eval_data = TensorDataset(eval_data)
        if eval_data is not None:
            eval_data = Subset(eval_data, range(min(eval_count, len(eval_data))))
        if isinstance(train_data[0], dict):  # padded: a step's loss is the mean over its loss tokens
            tokens = loss_tokens
    else:
        train, held_text = text_arrays()
        train_data, eval_data = TensorDataset(windows(train, seq_len)), TensorDataset(eval_windows(held_text, seq_len, eval_count))
    return Workload(model=model, train_data=train_data, eval_data=eval_data, loss=own_loss,
                    evaluate=held_out_loss if eval_data is not None else None,
                    tokens_per_sample=_predicted(train_data[0]), loss_tokens=tokens,
                    flops_per_token=flops_per_token(model, seq_len))


def _predicted(sample: Any) -> int:
    """The tokens one sample predicts (a window of n + 1 tokens predicts n; a dict sample of n input ids
    at most n - 1): what tokens per second count."""
    ids = sample["input_ids"] if isinstance(sample, dict) else _rows(sample)
    return int(torch.as_tensor(ids).shape[-1]) - 1


def _check_fits(model: torch.nn.Module, vocab: int | None, seq_len: int) -> None:
    """A vocabulary the model's embedding cannot hold, or windows longer than its positions: one line now,
    not an index error in every worker's first step."""
    config = model.config
    embedded = int(getattr(config, "vocab_size", 0) or 0)
    if vocab is not None and embedded and vocab > embedded:
        raise ValueError(f"workload hf: the data's vocabulary has {vocab} tokens and the model embeds {embedded}: "
                         f"use the tokenizer the model was trained with (prepare --tokenizer MODEL_DIR)")
    positions = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if positions and seq_len > int(positions):
        raise ValueError(f"workload hf: seq_len {seq_len} is longer than the model's {positions} positions")
