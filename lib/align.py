"""Accuracy alignment: run two setups from identical weights on identical batches, find the first divergence.

A *setup* is one way of computing the same model: a parallel layout, a
precision policy, remat, accumulation, any config override, or transformers
itself. Both start from the same weights and see the same batches; their
results are compared in the order a difference is best localised:

    forward   embedding output, every block's output, final norm, logits (one batch)
    loss      the mean next-token loss on that batch
    grads     the gradient, leaf by leaf (block leaves layer by layer)
    update    the parameter change made by one optimizer step, leaf by leaf
    curve     the loss at each of N training steps

Each row's error is a relative error ||a - b|| / ||a|| (for scalars |a - b| / |a|),
checked against a tolerance chosen by the lower of the two precisions
(`PROFILES`). The first failing row in that order names where to look.

Parallel layouts plug in through `SETUP_BUILDERS`: a builder turns (config,
weights, fault) into a `Setup`. single, fsdp and pipeline share one builder:
the recipe's own placement (lib/placement.py `make_placement`) places the same
weights on its mesh and supplies the forward+loss the train step runs, so
`parallel=...` is just one more override on one side. A pipeline's forward
rows are the un-pipelined forward of its placed (stage-sharded) weights: the
pipelined forward yields only the loss, so its loss, grads, update and curve
rows are where the pipeline schedule itself is compared.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from lib.align_faults import Fault
from lib.config import ARCHITECTURE, Config, ConfigError
from lib.model import Llama
from lib.optim import lr_schedule, make_optimizer
from lib.placement import make_placement
from lib.train_state import accumulated_grads, init_train_state, make_train_step

STAGES = ("forward", "loss", "grads", "update", "curve")


@dataclass(frozen=True)
class Tolerances:
    """Allowed relative error per stage."""

    forward: float
    loss: float
    grads: float
    update: float
    curve: float

    def scaled(self, factor: float) -> "Tolerances":
        return Tolerances(*(getattr(self, s) * factor for s in STAGES))


# float32: two correct fp32 implementations differ only by summation order (~1e-7 per op),
# which grows through layers, the backward pass and a few steps of training.
# bfloat16: an 8-bit mantissa rounds every matmul output by up to 2^-9 ~ 2e-3; over a few
# layers that compounds to a few 1e-2 on activations, more on gradients. Adam's first update
# is ~ lr * sign(g), so gradient entries near zero flip sign and the update differs by tens of
# percent in bf16. These are the gaps docs/alignment.md measures; larger ones are real bugs.
PROFILES = {
    "float32": Tolerances(forward=1e-5, loss=1e-6, grads=1e-4, update=1e-3, curve=1e-4),
    "bfloat16": Tolerances(forward=3e-2, loss=5e-3, grads=5e-2, update=3e-1, curve=1e-2),
}


@dataclass
class AlignConfig:
    """`align.*` keys of `python -m recipes.align`."""

    steps: int = 5  # training steps compared in the loss curve
    report: str = "runs/align/report.json"
    init_from: str = ""  # weights for both setups (HF folder, weights folder, run_dir); default: random init
    tolerance: str = "auto"  # auto (lower precision of the two) | float32 | bfloat16
    rtol_scale: float = 1.0  # multiply every tolerance
    # Self-test knob: plant a known difference in setup b (lib/align_faults.py): layer_scale:L:F,
    # shift_labels or grad_scale:LEAF[:L]:F; the table must name where it was planted.
    fault: str = ""


# ----------------------------------------------------------------------------- setups


class Setup(Protocol):
    name: str
    description: str

    # Batches are host numpy rows {tokens, mask[, segment_ids]}; results come back as host numpy.
    def forward(self, rows: dict) -> dict[str, np.ndarray]: ...  # embed, layers [L, ...], hidden, logits

    def loss_and_grads(self, rows: dict) -> tuple[float, dict[str, np.ndarray]]: ...  # grads named by leaf path

    def train(self, batches: list[dict]) -> tuple[list[float], dict[str, np.ndarray]] | None: ...  # None: cannot train


def leaf_name(path) -> str:
    return ".".join(str(getattr(k, "name", getattr(k, "key", k))) for k in path)


def named_leaves(tree) -> dict[str, np.ndarray]:
    """{"embed": ..., "blocks.attn.wq": [L, ...], ...} as float32 numpy, in the model's leaf order."""
    flat = jax.tree_util.tree_flatten_with_path(eqx.filter(tree, eqx.is_array))[0]
    return {leaf_name(p): np.asarray(x, np.float32) for p, x in flat}


@eqx.filter_jit
def _forward(model: Llama, tokens, segment_ids):
    hidden, layers = model.hidden(tokens, segment_ids=segment_ids, collect=True)
    return {"embed": model.embed_tokens(tokens), "layers": layers, "hidden": hidden, "logits": model(tokens, segment_ids=segment_ids)}


@eqx.filter_jit
def _loss_and_grads(model: Llama, batch: dict, accum_steps: int, z_loss: float, loss_sum: Callable):
    (loss, grads), _ = accumulated_grads(model, batch, accum_steps, z_loss, loss_sum)
    return loss, grads


_STEPS: dict[tuple, tuple] = {}


def _optimizer_and_step(cfg: Config, model: Llama, loss_sum: Callable, fault: Fault):
    """The recipe's optimizer and jitted train step, built once per distinct config (compiling it is the slow part).
    Equal parallel configs make equal placements, so their loss functions are interchangeable."""
    key = (repr(cfg.optim), cfg.trainer.steps, model.cfg, repr(cfg.parallel), fault.changes_loss and fault)
    if key not in _STEPS:
        optimizer = make_optimizer(cfg.optim, model, cfg.trainer.steps)
        step = make_train_step(optimizer, lr_schedule(cfg.optim, cfg.trainer.steps), cfg.optim.accum_steps, cfg.optim.z_loss,
                               loss_sum=loss_sum)
        _STEPS[key] = (optimizer, step)
    return _STEPS[key]


class JaxSetup:
    """The training code as `recipes.pretrain` runs it: the same placement, gradient function and jitted step.

    The layout is the recipe's placement for `cfg.parallel` (lib/placement.py): it puts the
    TrainState where it lives, turns host rows into device arrays, supplies the forward+loss
    (`loss_sum`, pipelined for a pipeline) and keeps the step's shardings. Batches arrive as
    host numpy rows; results go back as host numpy.
    """

    def __init__(self, name: str, cfg: Config, model: Llama, fault: Fault = Fault("")):
        self.name, self.cfg = name, cfg
        self.placement = placement = make_placement(cfg)
        self.loss_sum = fault.loss_sum(placement.loss_sum, placement.model_view)
        self.optimizer, self.step = _optimizer_and_step(cfg, model, self.loss_sum, fault)
        weights = fault.weights(model)
        # Built from the concrete weights on their way to the mesh: both setups hold the same numbers.
        self.state = placement.init_state(lambda: init_train_state(weights, self.optimizer, cfg.trainer.seed))
        m, o = cfg.model, cfg.optim
        layout = str(placement) + (", forward rows un-pipelined on the placed weights" if placement.schedule_line() else "")
        self.description = f"parallel={cfg.parallel.name} ({layout}) compute={m.compute_dtype} remat={m.remat} accum={o.accum_steps}"

    def forward(self, rows):
        batch = self.placement.train_batch(rows)
        out = _forward(self.placement.model_view(self.state.model), batch["tokens"], batch.get("segment_ids"))
        return {k: np.asarray(v, np.float32) for k, v in out.items()}

    def loss_and_grads(self, rows):
        loss, grads = _loss_and_grads(self.state.model, self.placement.train_batch(rows), self.cfg.optim.accum_steps,
                                      self.cfg.optim.z_loss, self.loss_sum)
        return float(loss), named_leaves(grads)

    def train(self, batches):
        before = named_leaves(self.state.model)
        # The step donates its state: train a copy so self.state stays usable.
        state = jax.tree.map(jnp.copy, self.state)
        step = self.placement.train_step(self.step, state)
        losses, update = [], {}
        for i, rows in enumerate(batches):
            state, metrics = step(state, self.placement.train_batch(rows))
            losses.append(float(metrics["loss"]))
            if i == 0:
                update = {k: v - before[k] for k, v in named_leaves(state.model).items()}
        return losses, update


class HFReferenceSetup:
    """transformers' LlamaForCausalLM on the same weights (torch, fp32, CPU): forward, loss and grads only."""

    def __init__(self, name: str, cfg: Config, model: Llama):
        from lib.hf_reference import reference_from_model

        if cfg.optim.z_loss:
            raise ConfigError("b=hf compares the plain next-token loss; set optim.z_loss=0")
        self.name, self.cfg = name, cfg
        self.ref = reference_from_model(model, model.cfg)
        self.description = "transformers LlamaForCausalLM (torch fp32, eager attention)"

    def forward(self, batch):
        from lib.hf_reference import reference_forward

        out = reference_forward(self.ref, batch["tokens"], batch["mask"])
        return {k: out[k] for k in ("embed", "layers", "hidden", "logits")}

    def loss_and_grads(self, batch):
        from lib.hf_reference import reference_grads

        return reference_grads(self.ref, self.cfg.model, batch["tokens"], batch["mask"])

    def train(self, batches):
        return None  # no optax-identical optimizer on the torch side


SETUP_BUILDERS: dict[str, Callable[[str, Config, Llama, Fault], Setup]] = {"single": JaxSetup, "fsdp": JaxSetup, "pipeline": JaxSetup}


def build_setup(name: str, cfg: Config, model: Llama, fault: Fault = Fault("")) -> Setup:
    builder = SETUP_BUILDERS.get(cfg.parallel.name)
    if builder is None:
        raise ConfigError(f"align cannot build parallel={cfg.parallel.name} (known: {sorted(SETUP_BUILDERS)}); register a builder in lib.align.SETUP_BUILDERS")
    return builder(name, cfg, model, fault)


# ----------------------------------------------------------------------------- weights and faults


def same_weights(model: Llama, cfg: Config) -> Llama:
    """`model`'s arrays under `cfg.model`'s static choices (remat, compute dtype): identical weights."""
    from lib.weights import with_execution_config

    diff = [k for k in ARCHITECTURE if getattr(cfg.model, k) != getattr(model.cfg, k)]
    if diff:
        raise ConfigError(f"the two setups must share the model architecture to start from the same weights; they differ in {diff}")
    return with_execution_config(model, cfg.model)


# ----------------------------------------------------------------------------- comparison


@dataclass
class Row:
    stage: str
    name: str
    error: float  # relative error
    max_abs: float
    tolerance: float
    skipped: str = ""  # why the row could not be compared
    values: tuple[float, float] | None = None  # (a, b) for scalar rows: the loss itself

    @property
    def ok(self) -> bool:
        return bool(self.skipped) or (math.isfinite(self.error) and self.error <= self.tolerance)


@dataclass
class Report:
    setups: dict[str, dict]
    profile: str
    tolerances: Tolerances
    rows: list[Row] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    @property
    def first_divergence(self) -> Row | None:
        return next((r for r in self.rows if not r.ok), None)

    def to_json(self) -> dict:
        first = self.first_divergence
        return {
            "ok": self.ok,
            "first_divergence": None if first is None else dataclasses.asdict(first),
            "profile": self.profile,
            "tolerances": dataclasses.asdict(self.tolerances),
            "setups": self.setups,
            "rows": [dataclasses.asdict(r) | {"ok": r.ok} for r in self.rows],
        }

    def table(self) -> str:
        """One line per row; gradient/update rows of stacked leaves are folded to their worst layer."""
        lines = [f"{'stage':<8} {'what':<44} {'rel.error':>10} {'tolerance':>10}  result", "-" * 84]
        for stage in STAGES:
            rows = [r for r in self.rows if r.stage == stage]
            for name, group in _fold(rows, stage):
                worst = max(group, key=lambda r: (not r.ok, r.error if math.isfinite(r.error) else math.inf))
                label = name if len(group) == 1 else f"{name} (worst {worst.name[len(name):]} of {len(group)})"
                if worst.skipped:
                    lines.append(f"{stage:<8} {label:<44} {'-':>10} {'-':>10}  skipped: {worst.skipped}")
                else:
                    lines.append(f"{stage:<8} {label:<44} {worst.error:>10.3e} {worst.tolerance:>10.1e}  {'ok' if worst.ok else 'DIVERGED'}")
        first = self.first_divergence
        lines.append("-" * 84)
        lines.append("aligned: every row within tolerance" if first is None else
                     f"FIRST DIVERGENCE: {first.stage} {first.name} (rel.error {first.error:.3e} > {first.tolerance:.1e})")
        return "\n".join(lines)


def _fold(rows: list[Row], stage: str):
    if stage not in ("grads", "update"):
        return [(r.name, [r]) for r in rows]
    groups: dict[str, list[Row]] = {}
    for r in rows:
        groups.setdefault(r.name.split("[")[0], []).append(r)
    return list(groups.items())


def relative_error(a, b) -> tuple[float, float]:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    diff = a - b
    norm = float(np.linalg.norm(a))
    if not np.all(np.isfinite(b)):
        return math.inf, math.inf
    err = float(np.linalg.norm(diff)) / norm if norm > 0 else float(np.linalg.norm(diff))
    return err, float(np.abs(diff).max()) if diff.size else 0.0


def _leaf_rows(stage: str, a: dict, b: dict, tol: float) -> list[Row]:
    rows = []
    for name, x in a.items():
        y = b.get(name)
        if y is None:  # a leaf one setup has and the other lacks is a divergence in itself
            rows.append(Row(stage, f"{name} (missing in b)", math.inf, math.inf, tol))
        elif name.startswith("blocks."):  # layer by layer, so the row names the layer
            rows += [Row(stage, f"{name}[{i}]", *relative_error(x[i], y[i]), tol) for i in range(x.shape[0])]
        else:
            rows.append(Row(stage, name, *relative_error(x, y), tol))
    return rows


def compare(a: Setup, b: Setup, batches: list[dict], tol: Tolerances) -> list[Row]:
    """Every row of the alignment table, in stage order."""
    rows: list[Row] = []
    fa, fb = a.forward(batches[0]), b.forward(batches[0])
    rows.append(Row("forward", "embed", *relative_error(fa["embed"], fb["embed"]), tol.forward))
    for i in range(fa["layers"].shape[0]):
        rows.append(Row("forward", f"layer {i}", *relative_error(fa["layers"][i], fb["layers"][i]), tol.forward))
    rows.append(Row("forward", "final_norm", *relative_error(fa["hidden"], fb["hidden"]), tol.forward))
    rows.append(Row("forward", "logits", *relative_error(fa["logits"], fb["logits"]), tol.forward))

    loss_a, grads_a = a.loss_and_grads(batches[0])
    loss_b, grads_b = b.loss_and_grads(batches[0])
    rows.append(Row("loss", "loss", *relative_error(loss_a, loss_b), tol.loss, values=(loss_a, loss_b)))
    rows += _leaf_rows("grads", grads_a, grads_b, tol.grads)

    ta, tb = a.train(batches), b.train(batches)
    if ta is None or tb is None:
        who = a.name if ta is None else b.name
        rows.append(Row("update", "all leaves", math.nan, math.nan, tol.update, skipped=f"setup {who} does not train"))
        rows.append(Row("curve", "all steps", math.nan, math.nan, tol.curve, skipped=f"setup {who} does not train"))
        return rows
    (curve_a, update_a), (curve_b, update_b) = ta, tb
    rows += _leaf_rows("update", update_a, update_b, tol.update)
    for i, (la, lb) in enumerate(zip(curve_a, curve_b)):
        rows.append(Row("curve", f"step {i + 1} loss {la:.4f} vs {lb:.4f}", *relative_error(la, lb), tol.curve, values=(la, lb)))
    return rows


def tolerance_profile(cfg_a: Config, cfg_b: Config | None, choice: str) -> str:
    if choice != "auto":
        if choice not in PROFILES:
            raise ConfigError(f"align.tolerance={choice!r}: choose auto, {', '.join(PROFILES)}")
        return choice
    dtypes = {cfg_a.model.compute_dtype} | ({cfg_b.model.compute_dtype} if cfg_b else set())
    return "bfloat16" if "bfloat16" in dtypes else "float32"


def write_report(report: Report, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.to_json(), indent=2))
    return path
