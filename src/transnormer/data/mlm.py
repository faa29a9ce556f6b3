"""Masked-language-model collation (BERT recipe).

Of the non-special, non-padding positions, each is selected with probability ``mlm_probability`` (0.15).
A selected position becomes ``<mask>`` with probability ``mask_fraction`` (0.8), a random non-special
token with probability ``random_fraction`` (0.1), and is left unchanged otherwise (0.1). ``labels`` hold
the original id at selected positions and ``-100`` elsewhere, so the loss covers selected positions only.

All randomness comes from one seeded ``torch.Generator`` owned by the collator, so a run is reproducible;
``state_dict()`` / ``load_state_dict()`` carry that generator across a resume in the calling process.
In ``DataLoader`` workers (``num_workers > 0``) each worker re-seeds its own copy (see
:class:`MLMCollator`): the masks are reproducible from the loader's seed, but the main process's
``state_dict()`` does not hold the workers' generators, so a resume there does not continue them.
The training loop does not use this class: its MLM batches (``train/tasks.py``) draw each row's mask
from (seed, step, row) and resume exactly with or without workers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

__all__ = ["MLMCollator", "as_ids", "mask_tokens", "pad_sequences"]


def check_max_length(name: str, value) -> None:
    """A padded length: None or an int >= 1."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")


def as_ids(name: str, value, *, allow_bool: bool = False) -> torch.Tensor:
    """``value`` as a LongTensor of ids (or labels, or a 0/1 mask with ``allow_bool``). Floating-point
    values are refused, naming ``name``: a cast had truncated 5.9 to id 5 and a mask of 0.6 to 0."""
    t = torch.as_tensor(value)
    if t.numel() and (t.is_floating_point() or t.is_complex() or (t.dtype == torch.bool and not allow_bool)):
        raise TypeError(f"{name} must hold integers, got {t.dtype}")
    return t.long()


def pad_sequences(
    seqs: Sequence[Sequence[int] | torch.Tensor], pad_id: int, *, max_length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad variable-length id sequences.

    Returns:
        ``(input_ids, attention_mask)``, both ``LongTensor[B, L]`` with ``L = max(len)`` (or
        ``max_length``, which must be >= every length); the mask is 1 on real tokens.
    """
    if len(seqs) == 0:
        raise ValueError("seqs must not be empty")
    if isinstance(pad_id, bool) or not isinstance(pad_id, int):
        raise TypeError(f"pad_id must be an int, got {type(pad_id).__name__}")
    rows = [as_ids(f"seqs[{i}]", s) for i, s in enumerate(seqs)]
    for i, r in enumerate(rows):
        if r.ndim > 1:  # reshape(-1) had run a 2-D row's rows together silently
            raise ValueError(f"seqs[{i}] must be 1-D (a sequence of ids), got shape {tuple(r.shape)}")
    rows = [r.reshape(-1) for r in rows]
    length = max(len(r) for r in rows)
    check_max_length("max_length", max_length)
    if max_length is not None:
        if length > max_length:
            raise ValueError(f"a sequence has length {length} > max_length={max_length}")
        length = max_length
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        mask[i, : len(r)] = 1
    return ids, mask


def mask_tokens(
    input_ids: torch.Tensor,
    *,
    mask_id: int,
    vocab_size: int,
    special_ids: Iterable[int] = (),
    attention_mask: torch.Tensor | None = None,
    mlm_probability: float = 0.15,
    mask_fraction: float = 0.8,
    random_fraction: float = 0.1,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply BERT masking to ``input_ids [B, T]`` (not modified in place).

    Positions holding a special id, or with ``attention_mask == 0``, are never selected. Random
    replacements are drawn uniformly from the non-special ids in ``[0, vocab_size)``.

    Returns:
        ``(masked_input_ids, labels)``, both ``LongTensor[B, T]``; ``labels`` is ``-100`` where not selected.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
        raise TypeError("input_ids must be a 2-D integer tensor [B, T]")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer ids, got dtype {input_ids.dtype}")
    for name, p in (
        ("mlm_probability", mlm_probability),
        ("mask_fraction", mask_fraction),
        ("random_fraction", random_fraction),
    ):
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {p!r}")
    if mask_fraction + random_fraction > 1.0 + 1e-9:
        raise ValueError(f"mask_fraction + random_fraction must be <= 1, got {mask_fraction} + {random_fraction}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    if isinstance(mask_id, bool) or not isinstance(mask_id, int) or not 0 <= mask_id < vocab_size:
        raise ValueError(f"mask_id must be an int in [0, vocab_size={vocab_size}), got {mask_id!r}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}"
        )

    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab_size):
        raise ValueError(f"input_ids must lie in [0, vocab_size={vocab_size}), got ids in "
                         f"[{int(input_ids.min())}, {int(input_ids.max())}]")

    device = input_ids.device
    ids = input_ids.long().clone()
    special = torch.tensor(sorted({int(i) for i in special_ids} | {mask_id}), dtype=torch.long, device=device)
    maskable = ~torch.isin(ids, special)
    if attention_mask is not None:
        maskable &= attention_mask.to(device).bool()
    # Draw on the CPU generator, then move: keeps results identical across devices for one seed.
    probs = torch.full(ids.shape, float(mlm_probability))
    selected = torch.bernoulli(probs, generator=generator).bool().to(device) & maskable
    u = torch.rand(ids.shape, generator=generator).to(device)
    to_mask = selected & (u < mask_fraction)
    to_random = selected & (u >= mask_fraction) & (u < mask_fraction + random_fraction)

    labels = torch.where(selected, ids, torch.full_like(ids, -100))
    ids[to_mask] = mask_id
    allowed = torch.ones(vocab_size, dtype=torch.bool)
    allowed[special[special < vocab_size].cpu()] = False
    pool = allowed.nonzero().flatten()
    if len(pool) == 0:
        raise ValueError("every id in the vocabulary is special: nothing to draw random replacements from")
    picks = pool[torch.randint(len(pool), ids.shape, generator=generator)].to(device)
    ids[to_random] = picks[to_random]
    return ids, labels


class MLMCollator:
    """Collate examples (or re-mask a ready batch) for masked-LM training.

    Args:
        vocab_size, mask_id, pad_id: from the tokenizer (see :meth:`from_tokenizer`).
        special_ids: ids never selected (pad/bos/eos/unk/mask are typical).
        mlm_probability, mask_fraction, random_fraction: see the module docstring.
        seed: seed of the collator's ``torch.Generator``.
        max_length: pad a list of examples to this length (default: its longest); a longer example, or
            a ready batch dict longer than this, is refused (a batch dict is masked as it comes).

    Call with a list of examples ``{"input_ids": list|tensor, ...}`` (padded on the right with ``pad_id``)
    or with a batch dict holding ``input_ids [B, T]`` (e.g. from :class:`~transnormer.data.lm.LMBatchIterator`).
    Returns ``{"input_ids", "attention_mask", "labels"}`` ``LongTensor[B, T]`` (``attention_mask`` only
    when the input had one or padding was added).

    Inside ``DataLoader`` workers each worker re-seeds its generator from ``seed`` and the worker's seed
    (which the loader derives from the main process's RNG, or from its ``generator``), so workers do not
    repeat each other's masks. ``state_dict()`` then does not describe them (module docstring).
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        mask_id: int,
        pad_id: int | None = None,
        special_ids: Iterable[int] = (),
        mlm_probability: float = 0.15,
        mask_fraction: float = 0.8,
        random_fraction: float = 0.1,
        seed: int = 0,
        max_length: int | None = None,
    ) -> None:
        if mask_id is None:
            raise ValueError("mask_id: the tokenizer has no mask token; masked-LM needs one")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        check_max_length("max_length", max_length)  # (had waited for the first batch)
        if pad_id is not None and (isinstance(pad_id, bool) or not isinstance(pad_id, int)
                                   or not 0 <= pad_id < vocab_size):
            raise ValueError(f"pad_id must be an id in [0, vocab_size={vocab_size}) or None, got {pad_id!r}")
        self.vocab_size = vocab_size
        self.mask_id = mask_id
        self.pad_id = pad_id
        self.special_ids = frozenset(int(i) for i in special_ids) | ({pad_id} if pad_id is not None else set())
        self.mlm_probability = mlm_probability
        self.mask_fraction = mask_fraction
        self.random_fraction = random_fraction
        self.seed = seed
        self.max_length = max_length
        self.generator = torch.Generator().manual_seed(seed)
        self._worker_seeded: int | None = None
        # Validate the numbers once, on a dummy batch, so that a bad argument fails at construction.
        mask_tokens(
            torch.zeros((1, 1), dtype=torch.long),
            mask_id=mask_id,
            vocab_size=vocab_size,
            special_ids=self.special_ids,
            mlm_probability=mlm_probability,
            mask_fraction=mask_fraction,
            random_fraction=random_fraction,
            generator=torch.Generator().manual_seed(0),
        )

    @classmethod
    def from_tokenizer(cls, tokenizer, **kwargs) -> MLMCollator:
        """Build from a :class:`~transnormer.data.tokenizer.TextTokenizer` (ids and special ids)."""
        return cls(
            vocab_size=tokenizer.vocab_size,
            mask_id=tokenizer.mask_id,
            pad_id=tokenizer.pad_id,
            special_ids=tokenizer.special_ids,
            **kwargs,
        )

    def _maybe_reseed_for_worker(self) -> None:
        info = torch.utils.data.get_worker_info()
        if info is not None and self._worker_seeded != info.seed:
            self.generator.manual_seed((self.seed * 1_000_003 + info.seed) % (2**63))
            self._worker_seeded = info.seed

    def __call__(self, batch: Sequence[Mapping] | Mapping) -> dict[str, torch.Tensor]:
        if isinstance(batch, Mapping):
            if "input_ids" not in batch:
                raise ValueError("batch: a batch dict needs 'input_ids'")
            input_ids = as_ids("input_ids", batch["input_ids"])
            if self.max_length is not None and input_ids.shape[-1] > self.max_length:  # (had passed silently)
                raise ValueError(f"batch: input_ids has length {input_ids.shape[-1]} > max_length={self.max_length}")
            attention_mask = batch.get("attention_mask")
            if attention_mask is not None:
                attention_mask = as_ids("attention_mask", attention_mask, allow_bool=True)
        else:
            if len(batch) == 0:
                raise ValueError("batch must not be empty")
            for i, ex in enumerate(batch):
                if not isinstance(ex, Mapping) or "input_ids" not in ex:
                    raise TypeError(f"batch[{i}] must be a dict with 'input_ids'")
            if self.pad_id is None:
                raise ValueError("pad_id: needed to pad a list of examples; the tokenizer has no pad token")
            input_ids, attention_mask = pad_sequences(
                [ex["input_ids"] for ex in batch], self.pad_id, max_length=self.max_length
            )
        self._maybe_reseed_for_worker()
        masked, labels = mask_tokens(
            input_ids,
            mask_id=self.mask_id,
            vocab_size=self.vocab_size,
            special_ids=self.special_ids,
            attention_mask=attention_mask,
            mlm_probability=self.mlm_probability,
            mask_fraction=self.mask_fraction,
            random_fraction=self.random_fraction,
            generator=self.generator,
        )
        out = {"input_ids": masked, "labels": labels}
        if attention_mask is not None:
            out["attention_mask"] = attention_mask
        return out

    def state_dict(self) -> dict:
        """The generator state (resume masking exactly where it stopped)."""
        return {"seed": self.seed, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or "generator" not in state:
            raise TypeError("state must be a dict from MLMCollator.state_dict()")
        self.generator.set_state(state["generator"])
