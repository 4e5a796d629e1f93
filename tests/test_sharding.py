"""FSDP sharding: the rules (in-process, on shapes) and end-to-end runs on 8 simulated devices (subprocesses)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from lib import sharding
from lib.config import ConfigError, ModelConfig, OptimConfig, ParallelConfig
from lib.corpus import stdlib_corpus
from lib.metrics import read_metrics
from lib.model import Llama
from lib.optim import make_optimizer
from lib.train_state import init_train_state
from multidevice import finish, losses, rel_diff, start, subprocess_env

TINY = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=512)


def key(name):
    return jax.tree_util.GetAttrKey(name)


# ---- rules over the PyTree ------------------------------------------------------------------------------


def test_mesh_fills_minus_one_and_rejects_a_mismatch():
    assert sharding.resolve_mesh_shape(1, -1, 8) == (1, 8)
    assert sharding.resolve_mesh_shape(-1, 4, 8) == (2, 4)
    assert sharding.resolve_mesh_shape(2, 4, 8) == (2, 4)
    with pytest.raises(ConfigError, match=r"data=3 x fsdp=2 = 6 devices, but 8 are visible"):
        sharding.resolve_mesh_shape(3, 2, 8)
    with pytest.raises(ConfigError, match="8 is not divisible by 3"):
        sharding.resolve_mesh_shape(3, -1, 8)
    with pytest.raises(ConfigError, match="both -1"):
        sharding.resolve_mesh_shape(-1, -1, 8)
    with pytest.raises(ConfigError, match="parallel.fsdp=0"):
        sharding.resolve_mesh_shape(1, 0, 8)


def test_make_mesh_checks_the_visible_devices():
    with pytest.raises(ConfigError, match="but 1 are visible"):
        sharding.make_mesh(ParallelConfig(name="fsdp", data=2, fsdp=4), devices=jax.devices()[:1])


def test_leaf_rule_splits_one_dimension_of_large_matrices_only():
    blocks = (key("blocks"), key("attn"), key("wq"))
    # Stacked [layers, in, out]: the layer axis stays whole, the largest divisible dimension is split.
    assert sharding.leaf_spec(blocks, (4, 256, 512), 4, 8, 1024) == P(None, None, "fsdp")
    assert sharding.leaf_spec(blocks, (4, 256, 256), 4, 8, 1024) == P(None, "fsdp", None)  # tie: the first
    assert sharding.leaf_spec(blocks, (8, 3, 5), 4, 8, 0) == P()  # only the layer axis divides: kept whole
    assert sharding.leaf_spec((key("embed"),), (1001, 64), 4, 8, 1024) == P(None, "fsdp")  # 1001 % 8 != 0
    assert sharding.leaf_spec((key("blocks"), key("attn_norm"), key("weight")), (4, 4096), 4, 8, 0) == P()  # a vector per layer
    assert sharding.leaf_spec((key("embed"),), (512, 64), 4, 8, 10**9) == P()  # below min_shard_bytes
    assert sharding.leaf_spec((key("embed"),), (512, 64), 4, 1, 0) == P()  # fsdp=1: nothing to split


def test_optimizer_state_gets_the_same_specs_as_the_parameters():
    optimizer = make_optimizer(OptimConfig(), eqx.filter_eval_shape(Llama, TINY, jax.random.PRNGKey(0)), 10)
    state = eqx.filter_eval_shape(lambda: init_train_state(Llama(TINY, jax.random.PRNGKey(0)), optimizer, 0))
    specs = sharding.fsdp_partition_specs(state, 8, 16384)
    adam = specs.opt_state[1][0]
    assert specs.model.blocks.attn.wq == P(None, "fsdp", None)
    assert adam.mu.blocks.attn.wq == specs.model.blocks.attn.wq and adam.nu.lm_head == specs.model.lm_head
    assert specs.step == P() and specs.model.final_norm.weight == P()


def test_batch_must_split_over_the_mesh():
    mesh = sharding.make_mesh(ParallelConfig(name="fsdp", data=1, fsdp=1), devices=jax.devices()[:1])
    sharding.check_batch_divisible(8, 2, mesh)
    fake = type("FakeMesh", (), {"shape": {"data": 2, "fsdp": 4}})()
    with pytest.raises(ConfigError, match="make trainer.batch_size a multiple of 16"):
        sharding.check_batch_divisible(8, 2, fake)


def test_plan_table_lists_path_shape_spec_and_bytes():
    mesh = sharding.make_mesh(ParallelConfig(), devices=jax.devices()[:1])
    tree = {"w": jax.ShapeDtypeStruct((64, 32), np.float32)}
    text = sharding.format_plan(sharding.plan_rows(tree, sharding.state_shardings(tree, mesh, 0)))
    assert re.search(r"w\s+\(64, 32\)\s+P\(\)\s+8.00 KiB", text)
    assert "total" in text.splitlines()[-1]


# ---- end to end on 8 simulated devices ------------------------------------------------------------------

STEPS = 20
NO_EVAL = "trainer.eval_batches=0"  # only the first two runs evaluate (at the last step): compiling it costs seconds


def pretrain_args(run_dir, cache, *extra):
    return [
        "-m", "recipes.pretrain", "+exp=smoke", f"run_dir={run_dir}", f"data.cache_dir={cache}",
        f"trainer.steps={STEPS}", "trainer.batch_size=8", "trainer.ckpt_every=10", "trainer.keep_last=3",
        "trainer.eval_every=100", "trainer.peak_flops=1e12", "trainer.progress=false", "logger.wandb=disabled", *extra,
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """From scratch: 1 device, 8 devices, and 2 processes x 4 devices (launch/local.py), run concurrently."""
    root = tmp_path_factory.mktemp("fsdp")
    cache = root / "data"
    # The suite's persistent compilation cache (tests/conftest.py) if there is one: reruns skip compiling.
    jax_cache = Path(os.environ.get("JAX_COMPILATION_CACHE_DIR") or root / "jax-cache")
    stdlib_corpus(cache, seq_len=32, vocab_size=512, max_bytes=300_000, val_percent=5)  # once, before the runs
    dirs = {name: root / name for name in ("single", "fsdp8", "local2x4")}
    procs = {
        "single": start(pretrain_args(dirs["single"], cache), subprocess_env(1, jax_cache)),
        "fsdp8": start(pretrain_args(dirs["fsdp8"], cache, "parallel=fsdp", "parallel.print_plan=true"), subprocess_env(8, jax_cache)),
        "local2x4": start(
            ["-m", "launch.local", "--processes", "2", "--devices-per-process", "4", "--", *pretrain_args(dirs["local2x4"], cache, "parallel=fsdp", NO_EVAL)[2:]],
            subprocess_env(None, jax_cache),
        ),
    }
    done = finish(procs)
    for name, result in done.items():
        assert result.returncode == 0, f"{name} failed:\n{result.stderr[-3000:]}"
    return {"root": root, "cache": cache, "jax_cache": jax_cache, "dirs": dirs, "out": done}


def assert_same_losses(got: dict, want: dict, steps):
    for s in steps:
        assert rel_diff(got[s], want[s]) <= 1e-5, f"step {s}: {got[s]} vs {want[s]}"


def test_fsdp_on_8_devices_matches_one_device(runs):
    single, fsdp = losses(runs["dirs"]["single"]), losses(runs["dirs"]["fsdp8"])
    assert sorted(single) == sorted(fsdp) == list(range(1, STEPS + 1))
    assert_same_losses(fsdp, single, range(1, STEPS + 1))
    assert fsdp[STEPS] < fsdp[1]  # and it trains
    val = [[r["val_loss"] for r in read_metrics(runs["dirs"][name]) if "val_loss" in r] for name in ("single", "fsdp8")]
    assert len(val[0]) == len(val[1]) == 1 and rel_diff(val[1][0], val[0][0]) <= 1e-5  # evaluation, split over 8 devices


def test_each_device_holds_an_eighth_of_the_state(runs):
    err = runs["out"]["fsdp8"].stderr
    assert "mesh data=1 x fsdp=8" in err
    assert re.search(r"model\.blocks\.attn\.wq\s+\(2, 64, 64\)\s+P\(None, 'fsdp', None\)", err)
    held, total = map(int, re.search(r"measured: at most (\d+) of (\d+) state bytes on any of this process's 8 devices", err).groups())
    assert held <= 1.1 * total / 8, (held, total)


def test_two_processes_of_four_devices_match_one_process_of_eight(runs):
    assert "[process 1]" not in runs["out"]["local2x4"].stdout  # process 1 prints nothing to stdout
    assert_same_losses(losses(runs["dirs"]["local2x4"]), losses(runs["dirs"]["fsdp8"]), range(1, STEPS + 1))


def resume_copy(src, dst):
    """A run directory as it was at step 10: its newest checkpoint is step 10."""
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "checkpoints" / str(STEPS))
    return dst


def test_checkpoints_reshard_across_device_and_process_counts(runs):
    """8 devices in 2 processes -> 4 devices in 1; 8 devices -> 1; 1 device -> 8 devices in 2 processes."""
    root, dirs = runs["root"], runs["dirs"]
    resumed = {
        "on4": resume_copy(dirs["local2x4"], root / "resume_on4"),
        "on1": resume_copy(dirs["fsdp8"], root / "resume_on1"),
        "on8": resume_copy(dirs["single"], root / "resume_on8"),
    }
    cache, jax_cache = runs["cache"], runs["jax_cache"]
    on8 = pretrain_args(resumed["on8"], cache, "parallel=fsdp", NO_EVAL)[2:]
    done = finish({
        "on4": start(pretrain_args(resumed["on4"], cache, "parallel=fsdp", NO_EVAL), subprocess_env(4, jax_cache)),
        "on1": start(pretrain_args(resumed["on1"], cache, NO_EVAL), subprocess_env(1, jax_cache)),
        "on8": start(["-m", "launch.local", "--processes", "2", "--devices-per-process", "4", "--", *on8], subprocess_env(None, jax_cache)),
    })
    for name, result in done.items():
        assert result.returncode == 0, f"{name} failed:\n{result.stderr[-3000:]}"
        assert "(step 10)" in result.stderr
    assert "mesh data=1 x fsdp=4" in done["on4"].stderr
    for name, reference in (("on4", "local2x4"), ("on1", "fsdp8"), ("on8", "single")):
        got = losses(resumed[name])
        assert sorted(got) == list(range(1, STEPS + 1))  # rows past the checkpoint were replaced, not duplicated
        assert_same_losses(got, losses(dirs[reference]), range(11, STEPS + 1))


def test_bad_mesh_batch_or_parallelism_is_a_one_line_error(runs, tmp_path):
    done = finish({
        "mesh": start(pretrain_args(tmp_path / "a", runs["cache"], "parallel=fsdp", "parallel.data=3"), subprocess_env(8)),
        "batch": start(pretrain_args(tmp_path / "b", runs["cache"], "parallel=fsdp", "trainer.batch_size=12"), subprocess_env(8)),
        # parallel=single inside a multi-process launch would train N unrelated copies into one run_dir.
        "single": start(pretrain_args(tmp_path / "c", runs["cache"]), subprocess_env(8, JAX_COORDINATOR_ADDRESS="127.0.0.1:1", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="1")),
    })
    for name, result in done.items():
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (name, result.stderr)
    assert not any(tmp_path.iterdir())  # nothing written
    assert "8 is not divisible by 3" in done["mesh"].stderr
    assert "multiple of 8" in done["batch"].stderr
    assert "add parallel=fsdp" in done["single"].stderr
