"""`python -m orchestrator export RUN_DIR --hf OUT` (orchestrator/export.py), in process, on a run folder
written as a job leaves one (its `config.yaml` from the project's config, the final state in `model.pt`,
committed checkpoints in `checkpoints/`): the exported folder loads with `AutoModelForCausalLM` and gives
exactly the run's logits, keeps the tied weights and generates; a checkpoint exports the same way by step
or by file, a corrupted one is refused; the tokenizer of the workload's prepared `data_dir` goes with it;
a model that is not a transformers one, or an OUT that exists, is one line and exit 2; a failed export
leaves no OUT."""
from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("transformers", reason="the hf extra (pip install -e '.[hf]') is not installed")
import transformers

from actors.runs import checkpoints
from actors.training.workload import build_workload
from core.schema import JobConfig, parse
from orchestrator import cli
from orchestrator.export import export_hf
from orchestrator.prepare import PrepareOptions, prepare
from tests.unit.test_prepare import word_level_tokenizer

GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 32, "seq_len": 16,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
BATCH = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]])


def run_folder(root: Path, params: dict, factory: str = "orchestrator.workloads.hf:causal_lm") -> tuple[Path, JobConfig]:
    """A run folder with the config the job would have written (parsed and dumped by the project's schema)."""
    raw = {"name": "lm", "seed": 5, "workers": {"count": 2},
           "workload": {"factory": factory, "params": params, "batch_size": 4},
           "optimizer": {"name": "adamw", "lr": 0.001}, "stop": {"max_steps": 10}}
    config = parse(JobConfig, raw)
    run = root / "runs" / "lm" / "r1"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    return run, config


def trained_state(config: JobConfig, shift: float) -> tuple[torch.nn.Module, bytes]:
    """The workload's model moved away from its initial weights (as training would), and its state as
    the run writes it (`torch.save` of a dict whose `model` is the state dict)."""
    model = build_workload(config).model
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(torch.sin(torch.arange(p.numel(), dtype=p.dtype) + i + shift).reshape(p.shape) * 0.05)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "step": 10}, buffer)
    return model, buffer.getvalue()


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=BATCH).logits


def test_the_exported_folder_loads_and_gives_the_runs_logits_exactly(tmp_path, capsys):
    run, config = run_folder(tmp_path, GPT2)
    model, state = trained_state(config, 0.0)
    (run / "model.pt").write_bytes(state)
    out = tmp_path / "hf"
    assert cli.main(["export", str(run), "--hf", str(out)]) == 0
    assert f"exported the final model to {out}" in capsys.readouterr().out
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    assert torch.equal(logits(loaded), logits(model))
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # still tied
    generated = loaded.generate(BATCH[:1], max_new_tokens=5, do_sample=False)
    assert generated.shape == (1, BATCH.shape[1] + 5)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".hf")] == []


def test_a_committed_checkpoint_exports_by_step_or_by_file_and_a_corrupted_one_is_refused(tmp_path, capsys):
    run, config = run_folder(tmp_path, GPT2)
    models = {}
    for step, shift in ((4, 1.0), (8, 2.0)):
        models[step], blob = trained_state(config, shift)
        checkpoints.save(run, step, blob, keep=5, run_id="r1")
    data_file = next((run / "checkpoints").glob("step-00000004-*.pt"))
    for which in ("4", str(data_file)):
        written = export_hf(run, tmp_path / f"hf-{len(which)}", checkpoint=which)
        assert written.model == "the checkpoint of step 4"
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(written.folder), local_files_only=True)
        assert torch.equal(logits(loaded), logits(models[4]))
    assert cli.main(["export", str(run), "--hf", str(tmp_path / "none"), "--checkpoint", "5"]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint of step 5 in" in err and "(steps there: 4, 8)" in err, err
    data = bytearray(data_file.read_bytes())
    data[len(data) // 2] ^= 1
    data_file.write_bytes(bytes(data))
    assert cli.main(["export", str(run), "--hf", str(tmp_path / "bad"), "--checkpoint", "4"]) == 2
    err = capsys.readouterr().err
    assert "does not match its sha256" in err and err.count("\n") == 1, err
    assert not (tmp_path / "bad").exists()


def test_the_tokenizer_of_the_workloads_prepared_data_goes_with_the_model(tmp_path):
    """A prepared folder (a 256-token word-level tokenizer with an end-of-text token) named by the
    workload's `data_dir`: its tokenizer is saved beside the model, and its end-of-text id becomes the
    model's, so generation stops there."""
    word_level_tokenizer(tmp_path / "tokenizer.json", 254)
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text(" ".join(f"w{i % 254}" for i in range(500)))
    data = prepare(PrepareOptions(inputs=(str(tmp_path / "text"),), out=str(tmp_path / "data"), eval_fraction=0.0,
                                  tokenizer=str(tmp_path / "tokenizer.json")), err=io.StringIO())
    run, config = run_folder(tmp_path, {**GPT2, "data_dir": str(data.folder)})
    model, state = trained_state(config, 0.0)
    (run / "model.pt").write_bytes(state)
    written = export_hf(run, tmp_path / "hf")
    assert written.tokenizer == data.tokenizer
    tok = transformers.AutoTokenizer.from_pretrained(str(written.folder), local_files_only=True)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(written.folder), local_files_only=True)
    assert (len(tok), tok.eos_token_id, loaded.config.eos_token_id) == (256, 255, 255)
    prompt = torch.tensor([tok("w1 w2 w3")["input_ids"]])
    assert torch.equal(logits(loaded), logits(model))
    assert loaded.generate(prompt, max_new_tokens=5, do_sample=False).shape[1] <= prompt.shape[1] + 5


def test_a_model_that_is_not_a_transformers_one_is_refused_in_one_line(tmp_path, capsys):
    run, config = run_folder(tmp_path, {"size": "tiny", "n_layer": 1}, factory="orchestrator.workloads.lm:gpt")
    (run / "model.pt").write_bytes(trained_state(config, 0.0)[1])
    assert cli.main(["export", str(run), "--hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "export --hf needs a Hugging Face workload" in err and "orchestrator.load_model(" in err
    assert err.count("\n") == 1 and not (tmp_path / "hf").exists()


def test_an_existing_out_is_kept_and_a_failed_export_leaves_none(tmp_path, capsys, monkeypatch):
    run, config = run_folder(tmp_path, GPT2)
    (run / "model.pt").write_bytes(trained_state(config, 0.0)[1])
    (tmp_path / "kept").mkdir()
    assert cli.main(["export", str(run), "--hf", str(tmp_path / "kept")]) == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err and not any((tmp_path / "kept").iterdir())

    def torn(self, folder, **kwargs):
        (Path(folder) / "config.json").write_text("{}")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", torn)
    with pytest.raises(OSError, match="No space left"):
        export_hf(run, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept", "runs"], "a failed export left files behind"
