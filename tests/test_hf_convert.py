"""HF folder -> weights folder -> pretraining (trainer.init_from) -> export back to HF, through the CLIs."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import yaml

from lib.checkpoint import CheckpointError
from lib.config import ModelConfig, load_config
from lib.hf import load_llama, save_llama
from lib.model import Llama
from tests.fast_init import random_module
from lib.train_state import model_loss_sum
from lib.weights import load_model, read_architecture
from recipes import hf_convert, pretrain
from tests.test_align import on_tiny_corpus
from tests.test_hf import assert_same_model, assert_same_tensors, read_tensors

# Deliberately not the smoke model's shape: init_from must bring its own architecture.
SOURCE = ModelConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, vocab_size=320, tie_embeddings=True)


def test_import_pretrain_export(tmp_path, tiny_corpus, capsys):
    source = random_module(Llama, SOURCE, seed=0)
    save_llama(source, SOURCE, tmp_path / "hf")

    assert hf_convert.main(["import", str(tmp_path / "hf"), str(tmp_path / "weights")]) == 0
    assert "trainer.init_from=" in capsys.readouterr().err
    assert read_architecture(tmp_path / "weights") == SOURCE
    assert_same_model(source, load_model(tmp_path / "weights", SOURCE))

    run_dir = tmp_path / "run"  # where on_tiny_corpus puts it
    overrides = on_tiny_corpus(tiny_corpus, tmp_path, f"trainer.init_from={tmp_path / 'weights'}", "trainer.steps=1")
    pretrain.main(overrides)
    assert "initial weights from" in capsys.readouterr().err
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())["model"]
    assert (saved["d_model"], saved["n_layers"], saved["tie_embeddings"]) == (32, 1, True)

    # Step 1's loss is the imported model's loss on batch 0: training really started from those weights.
    from recipes.align import first_batches

    batch = first_batches(load_config(overrides), 1)[0]
    total, count = model_loss_sum(source, batch, 0.0)
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and abs(first["loss"] - float(total / count)) < 1e-5

    # Export the trained run; transformers-format weights equal the checkpoint's.
    assert hf_convert.main(["export", str(run_dir), str(tmp_path / "trained-hf")]) == 0
    trained, cfg = load_llama(tmp_path / "trained-hf")
    assert cfg == SOURCE
    assert_same_model(load_model(run_dir, SOURCE), trained)
    assert not np.array_equal(np.asarray(trained.embed), np.asarray(source.embed))  # one update happened

    # The imported weights export back to the original HF tensors bit for bit.
    assert hf_convert.main(["export", str(tmp_path / "weights"), str(tmp_path / "again")]) == 0
    assert_same_tensors(read_tensors(tmp_path / "hf"), read_tensors(tmp_path / "again"))


def test_cli_errors_are_one_line(tmp_path, capsys):
    source = random_module(Llama, SOURCE, seed=1)
    save_llama(source, SOURCE, tmp_path / "hf")
    assert hf_convert.main(["import", str(tmp_path / "hf"), str(tmp_path / "hf")]) == 2  # not empty
    assert hf_convert.main(["export", str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
    assert hf_convert.main(["export", str(tmp_path / "hf"), str(tmp_path / "hf")]) == 2  # would clobber the source
    err = capsys.readouterr().err
    assert "not empty" in err and "not an HF folder" in err and "already holds a model" in err
    assert all(line.startswith(("error: ",)) for line in err.strip().splitlines())
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]  # untouched
    with pytest.raises(CheckpointError, match="d_model: source 32 vs config 64"):
        load_model(tmp_path / "hf", dataclasses.replace(SOURCE, d_model=64))
