"""HF LLaMA interop: import/export round trips, sharding, errors, and the transformers reference check."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from safetensors import safe_open

from lib.checkpoint import CheckpointError
from lib.config import ModelConfig
from lib.hf import load_llama, logits, save_llama
from lib.model import Llama
from tests.fast_init import random_module

SMALL = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, vocab_size=61, rope_theta=5000.0, norm_eps=1e-6)


def read_tensors(folder):
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="numpy") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def assert_same_tensors(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8)), f"{k} differs"  # bit for bit


def assert_same_model(a: Llama, b: Llama):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y))


# ----------------------------------------------------------------------------- without torch


def test_export_import_round_trip_sharded(tmp_path):
    model = random_module(Llama, SMALL, seed=0)
    save_llama(model, SMALL, tmp_path / "one")
    save_llama(model, SMALL, tmp_path / "sharded", max_shard_bytes=20_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert_same_tensors(read_tensors(tmp_path / "one"), read_tensors(tmp_path / "sharded"))
    for folder in ("one", "sharded"):
        back, cfg = load_llama(tmp_path / folder)
        assert cfg == SMALL
        assert_same_model(model, back)


def test_bfloat16_export_rounds_once(tmp_path):
    model = random_module(Llama, SMALL, seed=1)
    save_llama(model, SMALL, tmp_path / "bf16", dtype="bfloat16")
    back, _ = load_llama(tmp_path / "bf16")
    save_llama(back, SMALL, tmp_path / "again", dtype="bfloat16")
    assert_same_tensors(read_tensors(tmp_path / "bf16"), read_tensors(tmp_path / "again"))
    np.testing.assert_allclose(np.asarray(back.embed), np.asarray(model.embed), rtol=2 ** -8)


def test_logits_api_shapes_and_checks(tmp_path):
    model = random_module(Llama, SMALL, seed=2)
    out = logits(model, np.zeros((2, 5), np.int64))
    assert out.shape == (2, 5, SMALL.vocab_size) and out.dtype == np.float32
    with pytest.raises(ValueError, match="token ids"):
        logits(model, np.full((1, 3), SMALL.vocab_size))
    with pytest.raises(ValueError, match="integer array"):
        logits(model, np.zeros((3,), np.int32))


def test_import_errors_are_one_line_and_name_the_fix(tmp_path):
    model = random_module(Llama, SMALL, seed=3)
    folder = save_llama(model, SMALL, tmp_path / "m")
    with pytest.raises(CheckpointError, match="already holds a model"):
        save_llama(model, SMALL, folder)  # never clobber an existing checkpoint by accident
    save_llama(model, SMALL, folder, overwrite=True)

    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}))
    with pytest.raises(CheckpointError, match="RoPE scaling"):
        load_llama(folder)
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(CheckpointError, match="missing tensors"):
        load_llama(folder)
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 40}))
    with pytest.raises(CheckpointError, match="shape"):
        load_llama(folder)
    with pytest.raises(CheckpointError, match="no config.json"):
        load_llama(tmp_path)


# ----------------------------------------------------------------------------- against transformers


HF_CONFIGS = {
    # grouped-query attention, untied head
    "gqa_untied": dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=61, tie_word_embeddings=False, rope_theta=5000.0, rms_norm_eps=1e-6),
    # multi-head, tied embeddings, three layers
    "mha_tied": dict(hidden_size=24, intermediate_size=40, num_hidden_layers=3, num_attention_heads=3,
                     num_key_value_heads=3, vocab_size=53, tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-5),
}


def random_hf_model(name: str, seed: int = 0):
    """A randomly initialised LlamaForCausalLM whose every weight (norms too) is random and O(1)-effective."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**HF_CONFIGS[name], max_position_embeddings=64, initializer_range=0.2, attn_implementation="eager")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.add_(0.3 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_logits_match_transformers(tmp_path, name):
    torch = pytest.importorskip("torch")
    ref = random_hf_model(name)
    ref.save_pretrained(tmp_path / "hf")
    model, cfg = load_llama(tmp_path / "hf")
    assert cfg.tie_embeddings == HF_CONFIGS[name]["tie_word_embeddings"] and (model.lm_head is None) == cfg.tie_embeddings

    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (3, 17))
    ours = np.asarray(logits(model, tokens), np.float64)
    with torch.no_grad():
        theirs = ref(torch.as_tensor(tokens)).logits.double().numpy()
    assert ours.std() > 0.5  # the check means something only if logits are far from uniform
    max_abs = np.abs(ours - theirs).max()
    log_p, log_q = (x - np.logaddexp.reduce(x, axis=-1, keepdims=True) for x in (theirs, ours))
    mean_kl = float((np.exp(log_p) * (log_p - log_q)).sum(-1).mean())
    print(f"{name}: max|dlogits|={max_abs:.2e} mean KL={mean_kl:.2e}")
    assert max_abs <= 1e-4 and mean_kl <= 1e-6

    # import -> export reproduces the HF tensors bit for bit, and transformers loads the export.
    save_llama(model, cfg, tmp_path / "back")
    assert_same_tensors(read_tensors(tmp_path / "hf"), read_tensors(tmp_path / "back"))
    from lib.hf_reference import load_reference

    reloaded = load_reference(tmp_path / "back")
    with torch.no_grad():
        assert torch.equal(reloaded(torch.as_tensor(tokens)).logits, ref(torch.as_tensor(tokens)).logits)


def test_sharded_transformers_checkpoint_imports(tmp_path):
    ref = random_hf_model("gqa_untied", seed=1)
    ref.save_pretrained(tmp_path / "one")
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    assert_same_model(load_llama(tmp_path / "one")[0], load_llama(tmp_path / "sharded")[0])
