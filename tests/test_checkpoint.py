import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lib import checkpoint as ckpt
from lib.config import ModelConfig, OptimConfig
from lib.model import Llama
from lib.optim import make_optimizer
from lib.train_state import init_train_state

CFG = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=50)
MODEL_META = {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_ff": 64, "vocab_size": 50}


def make_state(seed=0, cfg=CFG):
    model = Llama(cfg, jax.random.PRNGKey(seed))
    return init_train_state(model, make_optimizer(OptimConfig(), model, 10), seed)


def test_round_trip_restores_every_leaf_and_the_data_state(tmp_path):
    manager = ckpt.open_manager(tmp_path, keep_last=2)
    state = make_state(0)
    state = jax.tree.map(lambda x: x + 1 if x.dtype == jnp.float32 else x, state)
    ckpt.save(manager, 3, state, {"next_index": 7}, {"model": MODEL_META, "good": True})
    manager.wait_until_finished()
    restored, data_state, meta = ckpt.restore(manager, 3, make_state(1), MODEL_META)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(a, b)
    assert data_state == {"next_index": 7} and meta["good"] is True


def test_keeps_last_n_and_ignores_incomplete_steps(tmp_path):
    manager = ckpt.open_manager(tmp_path, keep_last=2)
    state = make_state()
    for step in (1, 2, 3):
        ckpt.save(manager, step, state, {}, {"model": MODEL_META})
    manager.wait_until_finished()
    assert ckpt.complete_steps(manager) == [2, 3]
    # A save killed half-way leaves a temporary folder: never chosen, removed on the next open.
    shutil.copytree(tmp_path / "3", tmp_path / "9.orbax-checkpoint-tmp-123")
    manager.close()
    reopened = ckpt.open_manager(tmp_path, keep_last=2)
    assert reopened.latest_step() == 3
    assert not any("tmp" in p.name for p in tmp_path.iterdir())


def test_saving_an_existing_step_replaces_it(tmp_path):
    manager = ckpt.open_manager(tmp_path, keep_last=3)
    ckpt.save(manager, 1, make_state(0), {"v": 1}, {"model": MODEL_META})
    ckpt.save(manager, 1, make_state(0), {"v": 2}, {"model": MODEL_META})
    manager.wait_until_finished()
    _, data_state, _ = ckpt.restore(manager, 1, make_state(0), MODEL_META)
    assert data_state == {"v": 2}


def test_different_model_shape_is_refused_without_touching_files(tmp_path):
    manager = ckpt.open_manager(tmp_path, keep_last=2)
    ckpt.save(manager, 1, make_state(), {}, {"model": MODEL_META})
    manager.wait_until_finished()
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(ckpt.CheckpointError, match="different model shape .*d_model: checkpoint 32 vs config 48"):
        ckpt.restore(manager, 1, make_state(), dict(MODEL_META, d_model=48))
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_execution_choices_may_differ_from_the_checkpoint(tmp_path):
    manager = ckpt.open_manager(tmp_path, keep_last=2)
    saved = dict(MODEL_META, remat="none", logits_chunk=64, attention_block=128, attention_impl="blocked", scan_unroll=1)
    ckpt.save(manager, 1, make_state(), {}, {"model": saved})
    manager.wait_until_finished()
    changed = dict(saved, remat="layer", logits_chunk=0, attention_block=16, attention_impl="cudnn", scan_unroll=2, compute_dtype="bfloat16")
    restored, _, _ = ckpt.restore(manager, 1, make_state(1), changed)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), restored, make_state()))


def test_damaged_checkpoint_is_a_clear_error(tmp_path):
    manager = ckpt.open_manager(tmp_path, keep_last=2)
    ckpt.save(manager, 1, make_state(), {}, {"model": MODEL_META})
    manager.wait_until_finished()
    for f in (tmp_path / "1" / "state").rglob("*"):
        if f.is_file() and f.stat().st_size > 100:
            f.write_bytes(b"garbage")
    with pytest.raises(ckpt.CheckpointError, match="cannot read checkpoint"):
        ckpt.restore(manager, 1, make_state(), MODEL_META)
    (tmp_path / "1" / "meta" / "metadata").write_text("{not json")
    with pytest.raises(ckpt.CheckpointError, match="no readable meta"):
        ckpt.restore(manager, 1, make_state(), MODEL_META)
