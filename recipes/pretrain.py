"""Pretrain a LLaMA-family model: `python -m recipes.pretrain +exp=quickstart [key=value ...]`.

The story: read the config, get the data, build the model and optimizer,
resume from the newest complete checkpoint if there is one, then loop:
batch -> jitted train step -> metrics -> (eval) -> (checkpoint).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from lib import checkpoint as ckpt
from lib.config import Config, to_dict, to_yaml
from lib.data import resolve_corpora, train_batches, val_batches
from lib.errors import run_cli
from lib.metrics import MetricsWriter, flops_per_token, peak_flops_per_device, peak_memory_bytes, read_metrics
from lib.model import Llama, count_params
from lib.optim import lr_schedule, make_optimizer
from lib.train_state import init_train_state, make_eval_step, make_train_step
from lib.weights import adopt_init_architecture, load_model

HOST_ONLY_KEYS = ("source", "index")  # sample identity stays on the host (for logs), not on the device


def device_batch(batch: dict) -> dict:
    return {k: jax.device_put(v) for k, v in batch.items() if k not in HOST_ONLY_KEYS}


def evaluate(eval_step, model, batches) -> float:
    total, count = 0.0, 0
    for batch in batches:
        s, n = eval_step(model, device_batch(batch))
        total, count = total + float(s), count + int(n)
    return total / max(count, 1)


def keep_metrics_up_to(run_dir: Path, step: int) -> None:
    """On resume, drop rows a killed run wrote past its last checkpoint, so each step appears once."""
    rows = [r for r in read_metrics(run_dir) if r.get("step", 0) <= step]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def train(cfg: Config) -> dict:
    cfg = adopt_init_architecture(cfg)  # trainer.init_from, when set, decides the model's shape
    run_dir = Path(cfg.run_dir)
    is_main = jax.process_index() == 0
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(cfg))

    # Data: the prepared corpora (the stdlib one is built on first use), a Grain iterator, fixed val batches.
    corpora = resolve_corpora(cfg.data, cfg.model.vocab_size)
    batches = train_batches(
        corpora, cfg.data, global_batch=cfg.trainer.batch_size, vocab_size=cfg.model.vocab_size,
        process_index=jax.process_index(), process_count=jax.process_count(),
        weights=[s.weight for s in cfg.data.sources],
    )
    data_iter = iter(batches)
    val = val_batches(corpora[0], cfg.data, batch_size=cfg.trainer.batch_size, n_batches=cfg.trainer.eval_batches, vocab_size=cfg.model.vocab_size)

    # Model, optimizer and the state that a checkpoint must hold.
    model = Llama(cfg.model, jax.random.PRNGKey(cfg.trainer.seed))
    schedule = lr_schedule(cfg.optim, cfg.trainer.steps)
    optimizer = make_optimizer(cfg.optim, model, cfg.trainer.steps)
    state = init_train_state(model, optimizer, cfg.trainer.seed)

    # Resume from the newest complete checkpoint, if any.
    manager = ckpt.open_manager(run_dir / "checkpoints", keep_last=cfg.trainer.keep_last, keep_every=cfg.trainer.keep_every, async_save=cfg.trainer.async_checkpoint)
    start = 0
    latest = manager.latest_step()
    if latest is not None:
        state, data_state, _ = ckpt.restore(manager, latest, state, to_dict(cfg)["model"])
        data_iter.set_state(data_state)
        start = int(state.step)
        if is_main:
            keep_metrics_up_to(run_dir, start)
            print(f"resumed from {manager.directory}/{latest} (step {start})", file=sys.stderr)
    elif cfg.trainer.init_from:
        state = init_train_state(load_model(cfg.trainer.init_from, cfg.model), optimizer, cfg.trainer.seed)
        if is_main:
            print(f"initial weights from {cfg.trainer.init_from}", file=sys.stderr)

    train_step = make_train_step(optimizer, schedule, cfg.optim.accum_steps, cfg.optim.z_loss)
    eval_step = make_eval_step()
    tokens_per_step = cfg.trainer.batch_size * cfg.data.seq_len
    flops_per_step = flops_per_token(cfg.model, cfg.data.seq_len) * tokens_per_step
    peak, peak_source = peak_flops_per_device(cfg.trainer.peak_flops)
    peak *= jax.device_count()
    writer = MetricsWriter(run_dir, enabled=is_main, wandb_mode=cfg.logger.wandb, project=cfg.logger.project,
                           name=cfg.logger.name or cfg.exp_name, config=to_dict(cfg), resume=start > 0)
    if is_main:
        print(
            f"{cfg.exp_name}: {count_params(model) / 1e6:.2f}M params ({count_params(model, False) / 1e6:.2f}M non-embedding), "
            f"{jax.device_count()} {jax.devices()[0].platform} device(s), {tokens_per_step} tokens/step, "
            f"steps {start}->{cfg.trainer.steps}, peak {peak:.3g} FLOP/s ({peak_source}), run_dir {run_dir}",
            file=sys.stderr,
        )

    def save(step: int) -> None:
        meta = {"step": step, "model": to_dict(cfg)["model"], "config": to_dict(cfg), "good": True}
        ckpt.save(manager, step, state, data_iter.get_state(), meta)

    bar = tqdm(total=cfg.trainer.steps, initial=start, unit="step", disable=not (is_main and cfg.trainer.progress), dynamic_ncols=True)
    last = {}
    t_prev = time.perf_counter()
    for step in range(start + 1, cfg.trainer.steps + 1):  # `step` counts optimizer updates from 1
        state, metrics = train_step(state, device_batch(next(data_iter)))
        metrics = {k: float(v) for k, v in metrics.items()}  # waits for the step: honest step time
        now = time.perf_counter()
        step_time, t_prev = now - t_prev, now
        last = {
            "step": step, **metrics, "tokens": step * tokens_per_step, "tokens_per_update": tokens_per_step,
            "tokens_per_s": tokens_per_step / step_time, "step_time": step_time,
            "mfu": flops_per_step / step_time / peak, "peak_memory": peak_memory_bytes(),
        }
        writer.write(last)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{last['tokens_per_s']:.0f}", refresh=False)
        bar.update(1)
        if val and (step % cfg.trainer.eval_every == 0 or step == cfg.trainer.steps):
            val_loss = evaluate(eval_step, state.model, val)
            writer.write({"step": step, "val_loss": val_loss, "val_ppl": float(np.exp(val_loss))})
            if is_main:
                bar.write(f"step {step}: loss {metrics['loss']:.4f}  val_loss {val_loss:.4f}  ppl {np.exp(val_loss):.1f}")
        if step % cfg.trainer.ckpt_every == 0 or step == cfg.trainer.steps:
            save(step)
        t_prev = time.perf_counter()  # eval and checkpoint time is not step time
    bar.close()
    manager.wait_until_finished()
    manager.close()
    writer.close()
    return last


def main(argv: list[str] | None = None) -> int:
    from lib.config import load_config

    return run_cli(lambda: train(load_config(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    sys.exit(main())
