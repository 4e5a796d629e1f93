"""recipes/plan.py: compile the train step ahead of time for N devices and report memory, FLOPs and the verdict."""

from __future__ import annotations

import math
import re

import jax
import pytest

from lib.config import ConfigError, load_config
from lib.metrics import flops_per_token
from multidevice import finish, start, subprocess_env
from recipes import plan


def test_plan_on_one_device_counts_the_whole_state(tmp_path):
    cfg = load_config(["+exp=smoke", "plan.devices=1", "plan.accelerator=v5e"])
    r = plan.plan(cfg)
    state = plan.abstract_state(cfg, plan.make_optimizer(cfg.optim, plan.eqx.filter_eval_shape(plan.Llama, cfg.model, jax.random.PRNGKey(0)), 10))
    params_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state.model))
    assert r["params_bytes_per_device"] == params_bytes
    assert 2 * params_bytes <= r["opt_state_bytes_per_device"] <= 2 * params_bytes + 64  # Adam's two moments + counts
    assert r["tokens_per_step"] == cfg.trainer.batch_size * cfg.data.seq_len
    assert r["model_flops_per_step"] == flops_per_token(cfg.model, cfg.data.seq_len) * r["tokens_per_step"]
    assert r["temp_bytes"] > 0 and r["peak_bytes_per_device"] >= r["argument_bytes"]
    assert r["fits"] is True
    text = plan.format_report(cfg, r)
    assert "fits on v5e" in text and "optimizer state" in text


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["plan.devices=1", "plan.accelerator=tpu9"], "plan.accelerator='tpu9': choose one of"),
        (["plan.devices=8", "parallel=fsdp"], "run `python -m recipes.plan` in a fresh process"),
        (["plan.devices=1", "parallel=fsdp", "parallel.data=2"], "1 is not divisible by 2"),
    ],
)
def test_bad_plans_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        plan.plan(load_config(["+exp=smoke", *overrides]))


def test_llama3_8b_on_two_h100_nodes_plans_here_and_does_not_fit_a_v5e():
    """The shipped 8B config, compiled for 16 simulated devices on this CPU; its 3.7 GiB of parameters per
    device (fp32, split 8 ways) plus Adam's 7.5 GiB and the activations exceed a v5e chip's 16 GiB."""
    result = finish({"plan": start(["-m", "recipes.plan", "+exp=llama3_8b_h100", "plan.accelerator=v5e"], subprocess_env())}, timeout=300)["plan"]
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "8.03B params on 16 devices (data=2 x fsdp=8)" in out
    assert re.search(r"parameters\s+3\.74 GiB", out) and re.search(r"optimizer state\s+7\.48 GiB", out)
    assert "tokens/step            524,288" in out
    assert "does NOT fit on v5e (16.00 GiB per chip" in out
