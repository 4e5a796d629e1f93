"""Training-curve plots: a valid PNG, skipped steps and rollbacks marked, runs overlaid."""

import json
import math

import pytest

from lib.config import ConfigError
from lib.plot import RunCurves, build_figure, plot_runs
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


def test_recipe_cli(tmp_path, capsys):
    a, b = write_run(tmp_path / "a", True), write_run(tmp_path / "b", False)
    assert plot_recipe.main([f"run_dir={a}", f"run_dir={b}", f"out={tmp_path / 'both.png'}"]) == 0
    assert (tmp_path / "both.png").is_file()
    assert plot_recipe.main([f"run_dir={a}"]) == 0 and (a / "plot.png").is_file()
    assert plot_recipe.main([f"run_dir={tmp_path / 'nothing'}"]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="unknown argument"):
        plot_recipe.parse(["runs/a"])
