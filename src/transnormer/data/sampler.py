"""Step-indexed batches of dataset indices: deterministic, shardable, resumable.

Batch ``k`` is a pure function of ``(seed, k)``: epoch ``e`` visits a permutation drawn from
``numpy.random.default_rng([seed, e])``; each global batch of ``batch_size·world_size`` indices is
split so rank ``r`` takes the ``r``-th slice. Resuming is restoring ``step``. The incomplete last
global batch of an epoch is dropped (so every rank sees the same number of batches).
"""

from __future__ import annotations

import numpy as np

from .lm import _check_pos_int  # the data package's int check (bools refused, numpy ints taken)


class StepBatchSampler:
    def __init__(self, num_items: int, batch_size: int, *, seed: int = 0, rank: int = 0, world_size: int = 1,
                 step: int = 0):
        for name, value, minimum in (("num_items", num_items, 0), ("batch_size", batch_size, 1),
                                     ("world_size", world_size, 1), ("rank", rank, 0), ("step", step, 0),
                                     ("seed", seed, 0)):  # (numpy seeds are non-negative ints)
            _check_pos_int(name, value, minimum)
        if rank >= world_size:  # another rank's batches
            raise ValueError(f"rank must be < world_size={world_size}, got {rank}")
        global_batch = batch_size * world_size
        if num_items < global_batch:
            raise ValueError(
                f"dataset has {num_items} items, fewer than one global batch "
                f"(batch_size {batch_size} x world_size {world_size})"
            )
        self.num_items, self.batch_size, self.seed = num_items, batch_size, seed
        self.rank, self.world_size, self.step = rank, world_size, step
        self.steps_per_epoch = num_items // global_batch
        self._perm_epoch, self._perm = -1, None

    def indices_at(self, step: int) -> np.ndarray:
        # (step -1 had been epoch -1, the "no permutation yet" mark: a TypeError indexing None)
        epoch, k = divmod(_check_pos_int("step", step, 0), self.steps_per_epoch)
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_items)
            self._perm_epoch = epoch
        g = self.batch_size * self.world_size
        start = k * g + self.rank * self.batch_size
        return self._perm[start:start + self.batch_size]

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        idx = self.indices_at(self.step)
        self.step += 1
        return idx

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed, "global_batch_size": self.batch_size * self.world_size,
                "num_items": self.num_items}

    def load_state_dict(self, state: dict) -> None:
        """Restore the position; the order it continues must be the one it was saved in (same seed,
        items and global batch; the world size may change with the per-rank batch)."""
        if not isinstance(state, dict) or "step" not in state:
            raise TypeError("state must be a dict from StepBatchSampler.state_dict()")
        mine = self.state_dict()
        for key in ("seed", "global_batch_size", "num_items"):
            if key in state and state[key] != mine[key]:
                raise ValueError(f"sampler state does not match this data ({key} {state[key]} saved, {mine[key]} now)")
        self.step = _check_pos_int("state['step']", state["step"], 0)
