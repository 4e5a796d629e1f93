import pytest

from lib.config import ConfigError, load_config


def test_experiment_composes_and_overrides_apply():
    cfg = load_config(["+exp=smoke", "trainer.steps=7", "model.n_layers=3"])
    assert cfg.exp_name == "smoke" and cfg.trainer.steps == 7 and cfg.model.n_layers == 3
    assert cfg.model.d_model == 64  # from model/tiny via the experiment


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.stepz=5", "stepz"),
        ("+trainer.stepz=5", "unknown config key 'trainer.stepz'"),
        ("+typo_top=1", "unknown config key 'typo_top'"),
        ("trainer.steps=many", "steps"),
        ("model=nonexistent", "nonexistent"),
        ("data.seq_len=1", "data.seq_len=1 is too short"),
        ("trainer.batch_size=6", "not divisible by optim.accum_steps=4"),
        ("model.n_kv_heads=3", "n_kv_heads"),
        ("trainer.profile_steps=0", "need profile_start >= 0 .0 = no profile. and profile_steps >= 1"),
        ("model.attention_impl=flash", "model.attention_impl='flash': choose blocked, cudnn"),
        ("model.attention_impl=cudnn", "runs in bf16 only: set model.compute_dtype=bfloat16"),
    ],
)
def test_bad_config_is_one_clear_line(override, message):
    extra = ["optim.accum_steps=4"] if "batch_size" in override else []
    with pytest.raises(ConfigError, match=message) as info:
        load_config(["+exp=smoke", override, *extra])
    assert "\n" not in str(info.value)
