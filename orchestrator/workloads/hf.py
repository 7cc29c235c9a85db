"""Any Hugging Face causal language model as a workload (the `hf` extra: `pip install -e '.[hf]'`).

    workload:
      factory: "orchestrator.workloads.hf:causal_lm"
      params: {model_type: gpt2, n_layer: 2, n_embd: 128, n_head: 4, seq_len: 64}

The model is built from a `transformers` configuration (`model_type` and its fields; random
initialization, nothing downloaded) or loaded from a local directory (`model_dir`, files only), and
trained with its own loss (`labels` = the inputs: the model shifts them). The text is the built-in
byte-level one (orchestrator/workloads/lm.py: the standard library's source, vocabulary 256), or the
user's own token ids: `data: "module:function"` names a function returning `(train, eval)`, each a
map-style dataset (or tensor) whose items are rows of `seq_len + 1` token ids.

The workers' steps are seeded per (job seed, slot, step), so a configuration's dropout draws differ
between workers as they would under DDP; set the `*_pdrop` / `*_dropout` fields to 0 for runs that
must equal single-process training exactly. `dtype`: float32 or bfloat16 (or float64, though
transformers takes a causal LM's loss in float32 whatever the model's dtype). Tied weights (the
output layer sharing the input embedding) stay tied: the model's parameters are listed once, and a
checkpoint's state loads into a fresh model built the same way.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils.data import TensorDataset

from core.factory import check_factory
from orchestrator.workloads import MapData, Workload
from orchestrator.workloads.lm import VOCAB, eval_windows, mean_loss, text_arrays, windows

try:
    import transformers
except ImportError as err:  # one line, naming the extra (check_factory reports it at config time)
    raise ImportError(f"orchestrator.workloads.hf needs the transformers package ({err}): "
                      f"pip install -e '.[hf]'") from None


def _rows(batch: Any) -> torch.Tensor:
    if isinstance(batch, (tuple, list)):
        batch = batch[0] if len(batch) == 1 else torch.stack([torch.as_tensor(b) for b in batch])
    return torch.as_tensor(batch)


def own_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The model's own causal-LM loss over a batch of token rows (the mean over the predicted tokens)."""
    rows = _rows(batch).to(device=next(model.parameters()).device, dtype=torch.long)
    loss = model(input_ids=rows, labels=rows).loss
    return loss.float() if loss.dtype in (torch.float16, torch.bfloat16) else loss


def held_out_loss(model: torch.nn.Module, data: TensorDataset | MapData, batch: int = 32) -> dict:
    rows = data.tensors[0] if isinstance(data, TensorDataset) else torch.stack([_rows(data[i]) for i in range(len(data))])
    loss = mean_loss(model, rows, own_loss, batch)
    return {"eval_loss": loss, "perplexity": math.exp(min(loss, 50.0))}


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
              eval_count: int = 64, data: str | None = None, **fields: Any) -> Workload:
    """A `transformers` causal LM (`model_type` with its configuration `fields`, or `model_dir`) on the
    built-in byte-level text or on `data` (see the module's text)."""
    if dtype not in ("float32", "bfloat16", "float64"):
        raise ValueError(f"workload hf: dtype must be float32, bfloat16 or float64, got {dtype!r}")
    model = build_model(model_type, model_dir, VOCAB, fields).to(getattr(torch, dtype))
    if data:
        train_data, eval_data = check_factory(data)()
        if isinstance(train_data, torch.Tensor):
            train_data = TensorDataset(train_data)
        if isinstance(eval_data, torch.Tensor):
            eval_data = TensorDataset(eval_data)
    else:
        train, held = text_arrays()
        train_data, eval_data = TensorDataset(windows(train, seq_len)), TensorDataset(eval_windows(held, seq_len, eval_count))
    return Workload(model=model, train_data=train_data, eval_data=eval_data, loss=own_loss, evaluate=held_out_loss,
                    tokens_per_sample=seq_len)
