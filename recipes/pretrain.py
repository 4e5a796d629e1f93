"""Pretrain a LLaMA-family model: `python -m recipes.pretrain +exp=quickstart [key=value ...]`.

The story: read the config, get the data, build the model and optimizer,
resume from the newest complete checkpoint if there is one, then loop:
batch -> jitted train step -> metrics -> guard -> (eval) -> (checkpoint).
The guard (docs/guard.md) skips bad steps inside the step, quarantines their
data and, when bad updates got through, rolls back to the last good checkpoint.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
from tqdm import tqdm

from lib import checkpoint as ckpt
from lib.config import Config, to_dict, to_yaml
from lib.data import resolve_corpora, sample_stream, train_batches, val_batches
from lib.errors import run_cli
from lib.evaluation import per_source_val_losses
from lib.faults import stalled_commit_path
from lib.guard import StepGuard
from lib.guard_host import HostGuard, check_guard_matches
from lib.host_memory import keep_freed_memory
from lib.metrics import MetricsWriter, flops_per_token, peak_flops_per_device, peak_memory_bytes, read_metrics
from lib.mixture import MixtureCounter
from lib.model import Llama, count_params
from lib.optim import lr_schedule, make_optimizer
from lib.placement import make_placement
from lib.profiling import StepProfiler
from lib.repro import write_bundle
from lib.train_state import init_train_state, make_eval_step, make_train_step
from lib.weights import adopt_init_architecture, load_model

HOST_ONLY_KEYS = ("source", "index")  # sample identity stays on the host (for logs), not on the device


def device_batch(batch: dict, put=jax.device_put) -> dict:
    return put({k: v for k, v in batch.items() if k not in HOST_ONLY_KEYS})


def evaluate(eval_step, model, batches, put=jax.device_put) -> float:
    total, count = 0.0, 0
    for batch in batches:
        s, n = eval_step(model, device_batch(batch, put))
        total, count = total + float(s), count + int(n)
    return total / max(count, 1)


def keep_metrics_up_to(run_dir: Path, step: int) -> None:
    """On resume, drop rows a killed run wrote past its last checkpoint, so each step appears once."""
    rows = [r for r in read_metrics(run_dir) if r.get("step", 0) <= step]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def train(cfg: Config) -> dict:
    if cfg.trainer.keep_host_memory:
        keep_freed_memory()  # before JAX starts its threads: they must all take the one malloc arena
    # Then: joining a multi-host run must precede any other JAX call, and a mesh or pipeline
    # that does not fit the devices stops here, before anything is written.
    placement = make_placement(cfg)
    cfg = adopt_init_architecture(cfg)  # trainer.init_from, when set, decides the model's shape
    run_dir = Path(cfg.run_dir)
    is_main = jax.process_index() == 0
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(cfg))

    # Data: the prepared corpora (the stdlib one is built on first use), a Grain iterator, fixed val batches.
    corpora = resolve_corpora(cfg.data, cfg.model.vocab_size)
    weights = [s.weight for s in cfg.data.sources]

    def open_batches(quarantined: frozenset, data_state: dict | None = None, *, whole_batch: bool = False):
        """The batch iterator at a data position, leaving `quarantined` samples out."""
        processes = (0, 1) if whole_batch else (jax.process_index(), jax.process_count())
        it = iter(train_batches(corpora, cfg.data, global_batch=cfg.trainer.batch_size, vocab_size=cfg.model.vocab_size,
                                process_index=processes[0], process_count=processes[1], weights=weights, quarantined=quarantined))
        if data_state is not None:
            it.set_state(data_state)
        return it

    data_iter = open_batches(frozenset())
    val = val_batches(corpora[0], cfg.data, batch_size=cfg.trainer.batch_size, n_batches=cfg.trainer.eval_batches, vocab_size=cfg.model.vocab_size)
    # A mixture also logs each source's held-out loss (val_loss/<name>) and the proportions drawn (mix/<name>).
    mix = MixtureCounter([c.name for c in corpora])
    val_sets = {c.name: val_batches(c, cfg.data, batch_size=cfg.trainer.batch_size, n_batches=cfg.trainer.eval_batches, vocab_size=cfg.model.vocab_size)
                for c in corpora} if len(corpora) > 1 else {}
    if is_main:  # the run keeps its tokenizer, so generation and evaluation need no data cache
        shutil.copyfile(corpora[0].tokenizer_path, run_dir / "tokenizer.json")

    # Model, optimizer and the state that a checkpoint must hold.
    key = jax.random.PRNGKey(cfg.trainer.seed)
    model = eqx.filter_eval_shape(Llama, cfg.model, key)  # shapes only: the real model is built where it lives
    schedule = lr_schedule(cfg.optim, cfg.trainer.steps)
    optimizer = make_optimizer(cfg.optim, model, cfg.trainer.steps)
    step_guard = StepGuard(cfg.guard) if cfg.guard.enabled else None
    state = placement.init_state(lambda: init_train_state(Llama(cfg.model, key), optimizer, cfg.trainer.seed, step_guard))
    if is_main and cfg.parallel.print_plan:
        print(placement.plan(state), file=sys.stderr)
    writer = None  # opened below; the guard's warning and rollback rows go through it

    def emit(row: dict) -> None:
        writer.write(row)
        if is_main and "message" in row:
            tqdm.write(f"guard: {row['message']}", file=sys.stderr)

    guard = HostGuard(cfg, run_dir, sample_stream(corpora, cfg.data, weights), emit, is_main)

    # Resume from the newest complete checkpoint, if any (Orbax never lists a half-written one).
    manager = ckpt.open_manager(
        run_dir / "checkpoints", keep_last=cfg.trainer.keep_last, keep_every=cfg.trainer.keep_every,
        async_save=cfg.trainer.async_checkpoint, keep_good=2 if cfg.guard.enabled else 0,
        temporary_path_class=stalled_commit_path(cfg.guard.fault.save_stall_s) if cfg.guard.fault.save_stall_s > 0 else None,
    )
    start, meta = 0, {}
    latest = manager.latest_step()
    if latest is not None:
        check_guard_matches(ckpt.read_meta(manager, latest), cfg)
        state, data_state, meta = ckpt.restore(manager, latest, state, to_dict(cfg)["model"])
        start = int(meta.get("step", state.step))  # the loop position; state.step counts applied updates only
        if is_main:
            print(f"resumed from {manager.directory}/{latest} (step {start})", file=sys.stderr)
    elif cfg.trainer.init_from:
        state = placement.init_state(
            lambda: init_train_state(load_model(cfg.trainer.init_from, cfg.model), optimizer, cfg.trainer.seed, step_guard))
        if is_main:
            print(f"initial weights from {cfg.trainer.init_from}", file=sys.stderr)
    # Rows a killed run logged past its last checkpoint (or before its first) are dropped: each step appears once.
    guard.resume(meta.get("guard"))
    if latest is not None:
        data_iter = open_batches(guard.quarantined(), data_state)
    if is_main:
        keep_metrics_up_to(run_dir, start)

    train_step = placement.train_step(
        make_train_step(optimizer, schedule, cfg.optim.accum_steps, cfg.optim.z_loss, step_guard, placement.loss_sum), state)
    eval_step = make_eval_step(placement.loss_sum)
    tokens_per_step = cfg.trainer.batch_size * cfg.data.seq_len
    flops_per_step = flops_per_token(cfg.model, cfg.data.seq_len) * tokens_per_step
    peak, peak_source = peak_flops_per_device(cfg.trainer.peak_flops)
    peak *= jax.device_count()
    writer = MetricsWriter(run_dir, enabled=is_main, wandb_mode=cfg.logger.wandb, project=cfg.logger.project,
                           name=cfg.logger.name or cfg.exp_name, config=to_dict(cfg), resume=start > 0)
    if is_main:
        print(
            f"{cfg.exp_name}: {count_params(state.model) / 1e6:.2f}M params ({count_params(state.model, False) / 1e6:.2f}M non-embedding), "
            f"{jax.device_count()} {jax.devices()[0].platform} device(s) ({placement}), {tokens_per_step} tokens/step, "
            f"steps {start}->{cfg.trainer.steps}, peak {peak:.3g} FLOP/s ({peak_source}), run_dir {run_dir}",
            file=sys.stderr,
        )
        if placement.schedule_line():
            print(placement.schedule_line(), file=sys.stderr)
    if placement_row := placement.log_row():
        writer.write({"step": start, **placement_row})

    def save(step: int) -> None:
        # A checkpoint saved while an anomaly is open may hold a bad update: never a rollback target.
        meta = {"step": step, "model": to_dict(cfg)["model"], "config": to_dict(cfg), "good": guard.good, "guard": guard.checkpoint_meta()}
        ckpt.save(manager, step, state, data_iter.get_state(), meta)

    profiler = StepProfiler(run_dir, cfg.trainer.profile_start, cfg.trainer.profile_steps, jax.process_index())
    bar = tqdm(total=cfg.trainer.steps, initial=start, unit="step", disable=not (is_main and cfg.trainer.progress), dynamic_ncols=True)
    last = {}
    t_prev = time.perf_counter()
    step = start
    while step < cfg.trainer.steps:
        step += 1  # `step` counts batches from 1 (a rollback sets it back)
        batch = guard.faults.corrupt_batch(next(data_iter))
        mix.add(batch["source"])
        with profiler.step(step):
            state, metrics = train_step(state, device_batch(batch, placement.train_batch))
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}  # one transfer; waits for the step: honest step time
        if (trace := profiler.after(step)) and is_main:
            bar.write(f"profile of steps {profiler.first}-{step}: {trace} (open it at https://ui.perfetto.dev)", file=sys.stderr)
        if guard.faults.poison_due(step, guard.monitor.rollbacks):
            state = guard.faults.poison(state, step)
        now = time.perf_counter()
        step_time, t_prev = now - t_prev, now
        last = {
            "step": step, **metrics, "tokens": step * tokens_per_step, "tokens_per_update": tokens_per_step,
            "tokens_per_s": tokens_per_step / step_time, "step_time": step_time,
            "mfu": flops_per_step / step_time / peak, "peak_memory": peak_memory_bytes(), **mix.fractions(),
        }
        writer.write(last)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{last['tokens_per_s']:.0f}", refresh=False)
        bar.update(1)
        if is_main and not cfg.trainer.progress and step % cfg.trainer.log_every == 0:  # logs without a bar
            print(f"step {step}: loss {metrics['loss']:.4f}  lr {metrics['lr']:.3g}  grad_norm {metrics['grad_norm']:.3f}  "
                  f"{last['tokens_per_s']:.0f} tokens/s", file=sys.stderr)
        verdict = guard.after_step(step, metrics, batch)
        if verdict.bundle:
            guard.monitor.bundles.append(step)
            manager.wait_until_finished()  # the bundle copies the newest checkpoint before this step
            if is_main:
                folder = write_bundle(run_dir, cfg, manager, step, metrics, lambda q, d: open_batches(q, d, whole_batch=True),
                                      guard.quarantined(), guard.faults, guard.monitor.rollbacks, guard.monitor.failures[str(step)])
                emit({"step": step, "event": "repro_bundle", "path": str(folder), "message": f"step {step} keeps failing: repro bundle {folder}"})
        if verdict.rollback:
            state, data_state, step = guard.roll_back(verdict.rollback, step, manager, state, to_dict(cfg)["model"])
            data_iter = open_batches(guard.quarantined(), data_state)
            bar.reset(total=cfg.trainer.steps)
            bar.update(step)
            t_prev = time.perf_counter()
            continue
        if val and (step % cfg.trainer.eval_every == 0 or step == cfg.trainer.steps):
            val_loss = evaluate(eval_step, state.model, val, placement.eval_batch)
            writer.write({"step": step, "val_loss": val_loss, "val_ppl": float(np.exp(val_loss))})
            guard.after_eval(step, val_loss, metrics.get("loss_mean", metrics["loss"]))
            if val_sets:
                writer.write({"step": step, **per_source_val_losses(eval_step, state.model, val_sets, lambda b: device_batch(b, placement.eval_batch))})
            if is_main:
                bar.write(f"step {step}: loss {metrics['loss']:.4f}  val_loss {val_loss:.4f}  ppl {np.exp(val_loss):.1f}")
        if step % cfg.trainer.ckpt_every == 0 or step == cfg.trainer.steps:
            save(step)
        t_prev = time.perf_counter()  # eval and checkpoint time is not step time
    bar.close()
    profiler.close()  # the run ended inside the window
    manager.wait_until_finished()
    manager.close()
    writer.close()
    if is_main:
        write_plot(run_dir)
    return last


def write_plot(run_dir: Path) -> None:
    """The run's curves as run_dir/plot.png; a plotting problem must never fail a finished run."""
    try:
        from lib.plot import plot_runs

        plot_runs([run_dir], run_dir / "plot.png")
    except Exception as exc:
        print(f"warning: could not write {run_dir / 'plot.png'} ({type(exc).__name__}: {exc})", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    from lib.config import load_config

    return run_cli(lambda: train(load_config(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    sys.exit(main())
