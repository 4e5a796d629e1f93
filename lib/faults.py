"""Deliberate faults for tests and fire drills (`guard.fault.*`, docs/guard.md).

The gradient faults (NaN gradient, loss spike) act inside the jitted step
(lib/guard.py, keyed on the step number). The ones here act on the host:

- a corrupt sample: the sample that row 0 of step s's batch holds in the
  unquarantined stream is "corrupt on disk": wherever it is read, its token ids
  are out of the vocabulary (after the data boundary check, as a bit flip
  would be), which makes the embedding lookup NaN;
- poisoned weights: after step s's update, Gaussian noise lands on every weight
  unchecked, as if a bad update got past the guard; it fires only before the
  run's first rollback, like a transient hardware fault;
- a stalled checkpoint commit, so a test can kill the process mid-save.
"""

from __future__ import annotations

import asyncio

import equinox as eqx
import grain
import jax
import numpy as np
import orbax.checkpoint as ocp

from lib.config import FaultConfig
from lib.quarantine import Identity, batch_identities


class HostFaults:
    def __init__(self, cfg: FaultConfig, stream: grain.MapDataset | None, global_batch: int, vocab_size: int):
        self.cfg = cfg
        self.vocab_size = vocab_size
        # Row 0 of step s holds stream position (s - 1) * global_batch when nothing is quarantined.
        self.corrupt: frozenset[Identity] = frozenset(
            (int(stream[(s - 1) * global_batch]["source"]), int(stream[(s - 1) * global_batch]["index"]))
            for s in cfg.corrupt_sample_steps
        ) if stream is not None else frozenset()

    def corrupt_batch(self, batch: dict) -> dict:
        """The batch as read from "disk": rows holding a corrupt sample get out-of-range token ids."""
        if not self.corrupt:
            return batch
        rows = np.array([ident in self.corrupt for ident in batch_identities(batch)])
        if not rows.any():
            return batch
        tokens = batch["tokens"].copy()
        tokens[rows] = self.vocab_size + 7  # out of range: jnp.take fills the embedding with NaN
        return {**batch, "tokens": tokens}

    def poison_due(self, step: int, rollbacks: int) -> bool:
        return step in self.cfg.poison_steps and rollbacks == 0

    def poison(self, state, step: int):
        """The state with noise of std poison_std added to every weight (the update that got through).

        Laid out exactly as the train step leaves its state (on a mesh the jitted noise would come back
        with equivalent but differently spelled shardings), as a bad update from the step itself would be.
        """
        noisy = _add_noise(state, jax.random.PRNGKey(step), self.cfg.poison_std)
        return jax.device_put(noisy, jax.tree.map(lambda x: x.sharding, state))


@eqx.filter_jit
def _add_noise(state, key, std):
    params, static = eqx.partition(state.model, eqx.is_inexact_array)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    noisy = [x + std * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    model = eqx.combine(jax.tree.unflatten(treedef, noisy), static)
    return eqx.tree_at(lambda s: s.model, state, model)


def stalled_commit_path(seconds: float) -> type:
    """An Orbax temporary-path class that waits `seconds` before committing (renaming) each checkpoint."""

    class StalledCommitPath(ocp.path.atomicity.AtomicRenameTemporaryPath):
        async def finalize(self, *args, **kwargs):
            await asyncio.sleep(seconds)  # the checkpoint is written but not committed: a kill now leaves *-tmp
            return await super().finalize(*args, **kwargs)

    return StalledCommitPath
