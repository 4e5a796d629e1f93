"""Training-curve plots: a valid PNG, skipped steps and rollbacks marked, runs overlaid."""

import json
import math

import pytest

from lib.config import ConfigError
from lib.plot import RunCurves, build_figure, loss_gap, plot_runs
from recipes import plot as plot_recipe


def write_run(folder, with_events: bool):
    rows = []
    for step in range(1, 21):
        row = {"step": step, "loss": 5 - step * 0.1, "lr": 1e-3, "grad_norm": 1.0 + step % 3, "tokens": step * 128, "tokens_per_update": 128}
        if with_events and step == 7:
            row |= {"skipped": 1, "loss": math.inf}
        rows.append(row)
        if step % 5 == 0:
            rows.append({"step": step, "val_loss": 5 - step * 0.09})
            rows.append({"step": step, "val_loss/a": 5.1 - step * 0.09, "val_loss/b": 4.9 - step * 0.09})
    if with_events:
        rows.insert(14, {"step": 12, "event": "rollback", "reason": "loss spike", "to_step": 10})
    folder.mkdir(parents=True)
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 21, "lo'  # a run still writing its last line
    (folder / "metrics.jsonl").write_text(text)
    return folder


def labelled(ax, label):
    return [line for line in ax.get_lines() if line.get_label() == label]


def test_png_is_written_and_readable(tmp_path):
    import matplotlib.image

    run = write_run(tmp_path / "run", with_events=True)
    out = plot_runs([run], tmp_path / "out" / "curves.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread(out).shape
    assert width > 1000 and height > 500


def test_skipped_steps_rollbacks_sources_and_tokens_axis_are_drawn(tmp_path):
    run = RunCurves(write_run(tmp_path / "run", with_events=True))
    assert len(run.train) == 20  # the half-written line is ignored
    fig = build_figure([run])
    loss_by_step, loss_by_tokens = fig.axes[0], fig.axes[3]
    assert list(labelled(loss_by_step, "skipped step")[0].get_xdata()) == [7]
    assert list(labelled(loss_by_tokens, "skipped step")[0].get_xdata()) == [7 * 128]
    assert list(labelled(loss_by_step, "rollback")[0].get_xdata()) == [12, 12]
    assert labelled(loss_by_step, "val a") and labelled(loss_by_step, "val b")
    train = labelled(loss_by_step, "train")[0]
    assert 7 not in list(train.get_xdata())  # the infinite loss is left out of the line, not drawn off-scale


def test_runs_are_overlaid_in_their_own_colours(tmp_path):
    a, b = write_run(tmp_path / "a", True), write_run(tmp_path / "b", False)
    fig = build_figure([RunCurves(a), RunCurves(b)])
    lines = {label: labelled(fig.axes[0], label)[0].get_color() for label in ("a train", "b train")}
    assert lines["a train"] != lines["b train"]


def write_shifted(folder, base_folder, shift, spike_step, spike):
    """A copy of a run's metrics with every loss moved by `shift` (by `spike` at `spike_step`)."""
    rows = [json.loads(line) for line in (base_folder / "metrics.jsonl").read_text().splitlines()[:-1]]
    for row in rows:
        for key in ("loss", "val_loss"):
            if key in row and math.isfinite(row[key]):
                row[key] += spike if row["step"] == spike_step and key == "loss" else shift
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_loss_gap_pairs_steps_and_finds_the_worst(tmp_path):
    a = write_run(tmp_path / "a", with_events=True)  # step 7's loss is inf: left out of the pairing
    b = write_shifted(tmp_path / "b", a, shift=0.01, spike_step=9, spike=-0.2)
    gap = loss_gap(RunCurves(a), RunCurves(b))
    assert gap["steps"] == 19
    assert gap["train_max_abs"] == pytest.approx(0.2) and gap["train_max_step"] == 9
    assert gap["train_mean_abs"] == pytest.approx((18 * 0.01 + 0.2) / 19)
    assert gap["train_mean"] == pytest.approx((18 * 0.01 - 0.2) / 19)
    assert gap["val_step"] == 20 and gap["val_other"] - gap["val_base"] == pytest.approx(0.01)
    assert loss_gap(RunCurves(a), RunCurves(a))["train_max_abs"] == 0
    fig = build_figure([RunCurves(a), RunCurves(b)])
    gap_by_step = fig.axes[3]  # a fourth column appears only when runs are compared
    assert len(fig.axes) == 8 and gap_by_step.get_title() == "loss - a loss"
    train = labelled(gap_by_step, "b train")[0]
    gaps = dict(zip(train.get_xdata(), train.get_ydata()))
    assert 7 not in gaps and gaps[9] == pytest.approx(-0.2) and gaps[10] == pytest.approx(0.01)
    assert list(labelled(gap_by_step, "b val")[0].get_ydata()) == pytest.approx([0.01] * 4)
    assert len(build_figure([RunCurves(a)]).axes) == 6


def test_recipe_cli(tmp_path, capsys):
    a, b = write_run(tmp_path / "a", True), write_run(tmp_path / "b", False)
    assert plot_recipe.main([f"run_dir={a}", f"run_dir={b}", f"out={tmp_path / 'both.png'}"]) == 0
    assert (tmp_path / "both.png").is_file()
    assert "loss gap to a (run - a, over the steps both logged):\n  b: train |gap| mean 0.0000" in capsys.readouterr().out
    assert plot_recipe.main([f"run_dir={a}"]) == 0 and (a / "plot.png").is_file()
    assert plot_recipe.main([f"run_dir={tmp_path / 'nothing'}"]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="unknown argument"):
        plot_recipe.parse(["runs/a"])
