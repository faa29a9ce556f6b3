"""The training loop: one function, read top to bottom.

    cfg = TrainConfig(task="clm", preset="t2-lm-tiny", data="stdlib", budget="2min", out_dir="runs/x")
    summary = train(cfg)

Everything it writes goes to ``out_dir``: ``metrics.jsonl`` (one line per step and per
evaluation), ``checkpoints/step-*/`` (atomic, resumable), ``loss.png``, ``summary.json``.
Parallelism is confined to ``setup_distributed()`` / ``wrap_model()``; run it under
``torchrun --nproc_per_node N`` for DDP.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import signal
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from .._files import atomic_write_text, check_output, held_alone, to_jsonable
from ..models.configuration import _SAVED_BY_HF, SAVED_LAYER_TYPES, check_overrides
from ..models.presets import MODEL_RULES, model_rules
from ..runtime import build_cpu_kernels, cpu_has_bf16_products, peak_rss_mb, reset_peak_rss
from .checkpoint import (
    STATE,
    latest_valid_checkpoint,
    list_checkpoints,
    load_model_weights,
    load_trainer_state,
    resolve_model_dir,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from .distributed import (
    DistInfo,
    all_reduce_sum,
    broadcast_buffers,
    check_strategy,
    cleanup,
    full_state,
    gather_objects,
    global_value,
    is_sharded,
    load_optimizer_state,
    main_first,
    setup_distributed,
    unwrap,
    wrap_model,
)
from .metrics import MetricsLogger, plot_curves, read_metrics, truncate_metrics
from .schedule import SCHEDULES, make_scheduler, refit
from .tasks import build_task_data


@dataclass
class TrainConfig:
    task: str = "clm"  # clm | mlm | cls
    preset: str | None = "t2-lm-tiny"
    config_file: str | None = None  # a config.json (overrides preset)
    overrides: dict = field(default_factory=dict)  # config fields, e.g. {"dropout": 0.0} (check_overrides)
    init_from: str | None = None  # pretrained model dir to fine-tune from
    data: str = "stdlib"
    data_seed: int = 0
    tokenizer: str | None = None  # a saved tokenizer / HF name; default: train a BPE on the data
    vocab_size: int = 8192
    cache_dir: str | None = None
    cls_read_kwargs: dict = field(default_factory=dict)
    no_truncate: bool = False
    seq_len: int = 256
    batch_size: int = 8  # per rank, per micro-step
    grad_accum: int = 1
    max_steps: int | None = None
    budget: str | None = None  # "50k" / "2M" tokens, or "90s" / "5min" / "1h"; with max_steps, whichever comes first
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    warmup_init_lr: float = 0.0  # fairseq's inverse_sqrt warms up from 1e-7 (spec §8)
    schedule: str = "cosine"
    weight_decay: float = 0.01
    weight_decay_all: bool = False  # decay biases, norm gains and LRPE θ too (fairseq's Adam: the paper's recipe)
    betas: tuple = (0.9, 0.98)
    adam_eps: float = 1e-8
    clip: float = 1.0  # 0 disables clipping
    dtype: str = "fp32"  # fp32 | bf16 (autocast)
    compile: bool = False
    gradient_checkpointing: bool = False  # recompute each block in the backward: memory for time
    strategy: str = "ddp"
    sync_batch_norm: bool = False  # batch norm statistics over every process (modules.norms.sync_batch_norm)
    device: str | None = None
    seed: int = 0
    out_dir: str = "runs/train"
    eval_every: int = 0  # steps; 0 = only at the end
    eval_every_s: float = 0.0  # seconds of training between evaluations (time budgets); 0 = off
    eval_batches: int | None = 50
    eval_stride: int | None = None
    mlm_packing: str | None = None  # mlm samples: "complete" (default; whole sentences, <s> first) | "contiguous"
    save_every: int = 0  # steps; 0 = only at the end
    keep_last: int = 3
    resume: bool = False
    log_every: int = 1
    grad_stats: bool = False
    stop_after: int | None = None  # stop (as if killed) after this step: for tests and demos
    progress: bool = True

    def check(self) -> None:
        """Raise on a bad field; the message names the field and, where `transnormer train` has one,
        its flag (``grad_accum (--grad-accum) must be >= 1``): the CLI's users had read field names."""
        try:
            self._check()
        except (ValueError, TypeError) as e:
            name, _, rest = str(e).partition(" ")
            if name in _FLAGS and rest.startswith(("must ", "applies ")):
                raise type(e)(f"{name} ({_FLAGS[name]}) {rest}") from None
            raise

    def _check(self) -> None:
        if self.task not in ("clm", "mlm", "cls"):
            raise ValueError(f"task must be 'clm', 'mlm' or 'cls', got {self.task!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"dtype must be 'fp32' or 'bf16', got {self.dtype!r}")
        # ints by type: 2.5 steps had trained 3, True 1; grad_accum=2.0 failed after the data and model
        # were built, and seq_len="32" in a comparison that did not name it
        for name in ("seq_len", "batch_size", "grad_accum", "log_every", "warmup", "eval_every", "save_every",
                     "keep_last", "seed", "data_seed", "vocab_size", "max_steps", "eval_batches", "stop_after"):
            value = getattr(self, name)
            if value is None and name in ("max_steps", "eval_batches", "stop_after"):
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
        for name in ("seed", "data_seed"):  # numpy's seeds are 32-bit
            if not 0 <= getattr(self, name) < 2**32:
                raise ValueError(f"{name} must be in [0, 2**32), got {getattr(self, name)}")
        for name in ("lr", "min_lr_ratio", "warmup_init_lr", "weight_decay", "adam_eps", "clip", "eval_every_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, got {value!r}")
        for name in ("seq_len", "batch_size", "grad_accum", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup", "eval_every", "eval_every_s", "save_every", "keep_last", "clip", "weight_decay",
                     "min_lr_ratio", "warmup_init_lr"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("clip", "weight_decay", "eval_every_s"):  # weight_decay=inf had saved NaN weights, rc 0
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)}"
                                 + (" (0 turns clipping off)" if name == "clip" else ""))
        if not 0 < self.lr < math.inf:
            raise ValueError(f"lr must be > 0 and finite, got {self.lr}")
        if self.warmup_init_lr and self.warmup < 2:  # a rate to warm up from, and no warm-up to use it
            raise ValueError(f"warmup_init_lr={self.warmup_init_lr} needs warmup >= 2: warm-up update k runs at "
                             "warmup_init_lr + (lr - warmup_init_lr) * k / warmup, so with warmup "
                             f"{self.warmup} it changes nothing")
        if self.min_lr_ratio != TrainConfig.min_lr_ratio and self.schedule != "cosine":  # (read by nothing)
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio} applies to schedule 'cosine' only, not "
                             f"{self.schedule!r}")
        if "num_labels" in self.overrides and self.task != "cls":  # a classifier's label count, for an LM
            raise ValueError(f"overrides (--set): num_labels applies to task 'cls' only, not {self.task!r}")
        if self.warmup_init_lr > self.lr:  # the warm-up would start above the peak and fall to it
            raise ValueError(f"warmup_init_lr must be <= lr = {self.lr}, got {self.warmup_init_lr}")
        if not 0 < self.adam_eps < math.inf:  # 0: an id never seen has m = v = 0, and 0/0 made its row NaN
            raise ValueError(f"adam_eps must be > 0 and finite, got {self.adam_eps}")
        betas = tuple(self.betas) if isinstance(self.betas, (tuple, list)) else None
        if betas is None or len(betas) != 2 or not all(
                not isinstance(b, bool) and isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        if not self.min_lr_ratio <= 1:  # a fraction of lr: above 1 the "decay" would raise the rate
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 (or None with a budget), got {self.max_steps}")
        if self.eval_batches is not None and self.eval_batches < 1:
            raise ValueError(f"eval_batches must be >= 1 (or None: the whole split), got {self.eval_batches}")
        if self.eval_stride is not None:  # the windows of a clm evaluation; checked here, not after training
            if self.task != "clm":
                raise ValueError(f"eval_stride applies to task 'clm' only, not {self.task!r}")
            if isinstance(self.eval_stride, bool) or not isinstance(self.eval_stride, int) or not (
                    1 <= self.eval_stride <= self.seq_len):
                raise ValueError(f"eval_stride must be an int in [1, seq_len = {self.seq_len}] (or None: seq_len), "
                                 f"got {self.eval_stride!r}")
        if self.mlm_packing is not None:
            if self.task != "mlm":
                raise ValueError(f"mlm_packing applies to task 'mlm' only, not {self.task!r}")
            if self.mlm_packing not in MLM_PACKINGS:
                raise ValueError(f"mlm_packing must be one of {MLM_PACKINGS}, got {self.mlm_packing!r}")
        if self.max_steps is None and self.budget is None:
            raise ValueError("give max_steps (--max-steps) or budget (--budget: tokens like '200k' or time like "
                             "'5min')")
        if self.budget is not None:
            parse_budget(self.budget)
        if self.task != "cls" and (self.cls_read_kwargs or self.no_truncate):  # they would change nothing
            raise ValueError("cls_read_kwargs (--text-column, --text-pair-column, --label-column, --header, "
                             f"--drop-label) and no_truncate apply to task 'cls' only, not {self.task!r}")
        if self.init_from and self.config_file:  # the pretrained model's own config.json is the config
            raise ValueError("give config_file (--config) or init_from (--init-from), not both")
        check_overrides(self.overrides)
        if self.init_from and set(self.overrides) - set(INIT_FROM_OVERRIDES):
            raise ValueError(f"overrides (--set): with init_from only {', '.join(INIT_FROM_OVERRIDES)} can change "
                             f"(the pretrained weights fix the rest), got {sorted(self.overrides)}")
        # The model's config checked with the overrides before any data work (an unknown preset, an
        # unreadable --config, or --set hidden_size=33 had failed after the corpus and tokenizer).
        config = None
        if self.preset and not (self.config_file or self.init_from):
            from ..presets import get_config

            config = get_config(self.preset, **self.overrides)
        if self.config_file:
            from ..models import TransNormerConfig

            try:
                raw = json.loads(Path(self.config_file).read_text())
                config = TransNormerConfig.from_dict(dict(raw))  # (as from_json_file: the file read once)
            except (OSError, ValueError) as e:
                raise ValueError(f"config_file (--config) {self.config_file!r} is not a readable JSON config: "
                                 f"{e}") from None
            # a misspelt key ("hiden_size") had been kept as a loose attribute, and the model built without it
            for key in (SAVED_LAYER_TYPES, *_SAVED_BY_HF):
                raw.pop(key, None)
            check_overrides(raw, types=False, where=f"config_file (--config) {self.config_file!r}")
            for k, v in self.overrides.items():
                setattr(config, k, v)
        if config is not None:
            try:  # the model's own field (vocab_size, dtype), not the TrainConfig field of that name
                config.check()
            except (ValueError, TypeError) as e:
                source = f"config_file (--config) {self.config_file!r}" if self.config_file else "the model"
                raise type(e)(f"{source} (with --set {self.overrides}): {e}" if self.overrides else
                              f"{source}: {e}") from None
            check_task_fits(config, self.task, f"config_file (--config) {self.config_file!r}" if self.config_file
                            else f"preset {self.preset!r}")
            if self.sync_batch_norm and config.norm_type != "batch":  # (wrap_model checks an init_from model)
                raise ValueError(f"sync_batch_norm (--sync-batch-norm) needs norm_type 'batch'; this model's "
                                 f"norm_type is {config.norm_type!r}")


# MLM samples: whole sentences packed into blocks with <s> first (fairseq's --sample-break-mode
# complete, the paper's recipe, data/mlm_blocks.py), or contiguous windows of the token stream.
MLM_PACKINGS = ("complete", "contiguous")


# What a resumed run may change: where and how often it reports and saves, not what it trains.
# batch_size is per rank: a run may resume on another number of processes with the same global
# batch, which the data iterators check.
RESUMABLE_CHANGES = ("out_dir", "resume", "eval_every", "eval_every_s", "eval_batches", "eval_stride", "save_every",
                     "keep_last", "log_every", "grad_stats", "stop_after", "progress", "device", "compile",
                     "gradient_checkpointing",  # recomputation gives the same numbers: a run out of memory resumes
                     "cache_dir", "batch_size",
                     # None and "complete" are one packing; a real change is refused by the data
                     # iterator's resume check, which names it
                     "mlm_packing")


# What --set may change in a model loaded with init_from: its weights fix every other field. (The pooling
# reads the encoder's output for the head: a fine-tune's new head, or a classifier's, as asked.)
INIT_FROM_OVERRIDES = ("dropout", "attention_dropout", "classifier_dropout", "classifier_pooling")


def run_name(cfg: TrainConfig) -> str:
    """What the run trains: a pretrained model or a config file wins over the (defaulted) preset."""
    return cfg.init_from or cfg.config_file or cfg.preset


def check_task_fits(config, task: str, model: str) -> None:
    """A causal LM must not see the tokens it predicts, a masked LM must see both sides of a mask.
    ``model`` names the model in the message."""
    causal = getattr(config, "causal", True)
    if task == "clm" and not causal:
        raise ValueError(f"task 'clm' needs a causal model, but {model} is bidirectional (causal=False); use an LM "
                         "(-lm) preset or task 'mlm'")
    if task == "mlm" and causal:
        raise ValueError(f"task 'mlm' needs a bidirectional model, but {model} is causal (causal=True); use a "
                         "-roberta preset (e.g. t2-roberta-tiny)")


def check_model_fits(config, cfg: TrainConfig, vocab_size: int) -> None:
    """The model must suit the task and cover the tokenizer's ids (before any training)."""
    check_task_fits(config, cfg.task, run_name(cfg))
    if config.vocab_size < vocab_size:  # an embedding lookup past its end
        raise ValueError(f"vocab_size {config.vocab_size} is below the tokenizer's {vocab_size} ids; "
                         "leave vocab_size unset (it follows the tokenizer) or give a smaller tokenizer")


def config_changes(saved: dict, cfg: TrainConfig) -> list[str]:
    """Fields of ``cfg`` that differ from a checkpoint's saved config and would change the training."""
    now = json.loads(json.dumps(asdict(cfg), default=str))
    saved = json.loads(json.dumps(saved, default=str))
    return [f"{k}: {saved.get(k)!r} -> {v!r}" for k, v in now.items()
            if k not in RESUMABLE_CHANGES and k in saved and saved[k] != v
            and not (k in _PATH_FIELDS and _same_path(saved[k], v))]


# Model config entries that are not the model: where it was saved from and by what, the label names
# (set from the data after the model is built) and problem_type (set by the first loss).
_NOT_THE_MODEL = (*(_SAVED_BY_HF - {"model_type"}), "id2label", "label2id", "problem_type")


def model_config_changes(model, ckpt: Path) -> list[str]:
    """Entries of ``model``'s config that differ from the one saved in checkpoint ``ckpt``."""
    if not (Path(ckpt) / "config.json").is_file():
        return []
    saved = type(model.config).from_pretrained(ckpt).to_dict()
    now = model.config.to_dict()
    return [f"model {k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(saved) | set(now))
            if k not in _NOT_THE_MODEL and saved.get(k) != now.get(k)]


# Fields naming a file or folder: the same one spelled another way (relative, absolute, through a
# link) is no change. (Other data under the same name is: the training batches' fingerprint.)
_PATH_FIELDS = ("data", "tokenizer", "init_from", "config_file")


def _same_path(a, b) -> bool:
    if isinstance(a, str) and isinstance(b, str) and a.startswith("lra:") and b.startswith("lra:"):
        # lra:TASK[:ROOT], its folder saved as given (or left out: the default) before it was saved
        # resolved: the same task and folder
        from .lra_tasks import default_root

        (ta, _, ra), (tb, _, rb) = a[4:].partition(":"), b[4:].partition(":")
        return ta == tb and _same_path(ra or default_root(ta) or "", rb or default_root(tb) or "")
    try:
        return isinstance(a, str) and isinstance(b, str) and os.path.samefile(a, b)
    except (OSError, ValueError):  # a name that is not a path here (stdlib, hf:…), or gone
        return False


def parse_budget(budget: str) -> tuple[str, float]:
    """'2min' / '90s' / '1.5h' → ('seconds', x); '200k' / '2M' / '12345' → ('tokens', n)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|sec|m|min|h|k|K|M|G|B)?\s*", str(budget))
    if not m:
        raise ValueError(f"budget must look like '200k' (tokens) or '5min' (time), got {budget!r}")
    x, unit = float(m.group(1)), m.group(2) or ""
    if x <= 0:  # nothing to train: 0 tokens had still run one step, 0 seconds saved an untrained step 0
        raise ValueError(f"budget must be > 0, got {budget!r}")
    if unit in ("s", "sec"):
        return "seconds", x
    if unit == "m":  # '2m' read as 2 minutes had trained 2 minutes for a user who meant 2M tokens
        raise ValueError(f"budget {budget!r} is ambiguous: write '{m.group(1)}min' (minutes) or "
                         f"'{m.group(1)}M' (million tokens)")
    if unit == "min":
        return "seconds", 60 * x
    if unit == "h":
        return "seconds", 3600 * x
    return "tokens", x * {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "B": 1e9}[unit]


SCHEDULE_FIT_STEP = 5  # a time budget's schedule is fitted to the steps it will get, from this step on
_UNFITTED = 10**9  # the schedule's length until a time budget's fit sets it


def fit_total_steps(step: int, elapsed: float, budget_s: float, step_times: list[float]) -> int:
    """The step count a time budget of ``budget_s`` seconds will reach, for the schedule: ``step``
    steps done in ``elapsed`` seconds in all, this process's steps after its first taking
    ``step_times``. Their median is the rate: the first step carries one-off costs (building the
    CPU kernels at first use took 13.7 s in a fresh clone, against ~0.12 s a step after it), and a
    slow spell of a shared machine must not stand for the run (one step of 2.3 s among three had
    fitted 42 steps to a run of 234, which then spent 130 steps at the floor rate). The loop fits
    from step ``SCHEDULE_FIT_STEP`` on, and again each time this process's steps double."""
    per_step = float(np.median(step_times))
    left = max(0.0, budget_s - elapsed)
    return max(step + 1, step + int(left / max(per_step, 1e-6)))


def special_token_ids(tokenizer) -> dict:
    """The tokenizer's pad/bos/eos ids as config fields (None where it has no such token): a saved
    model's config.json and generation_config.json must name the tokens its tokenizer uses."""
    return {f"{name}_token_id": getattr(tokenizer, f"{name}_id", None) for name in ("pad", "bos", "eos")}


def model_config_for(cfg: TrainConfig, vocab_size: int, num_labels: int | None, special_ids: dict):
    """The TransNormerConfig of a run: preset or config file, with the run's overrides, vocabulary
    and the tokenizer's special ids (:func:`special_token_ids`)."""
    from ..models import TransNormerConfig
    from ..models.presets import current_model_rules
    from ..presets import get_config

    extra = {"num_labels": num_labels} if num_labels else {}
    overrides = dict(cfg.overrides)
    given = overrides.pop("num_labels", num_labels) if num_labels else num_labels
    if given != num_labels:  # (had been get_config's "multiple values for num_labels", or silently dropped)
        raise ValueError(f"overrides (--set): num_labels={given!r}, but the data's labels give {num_labels} classes; "
                         "the count comes from the data (leave num_labels out)")
    overrides.setdefault("vocab_size", vocab_size)
    for name, value in special_ids.items():
        overrides.setdefault(name, value)
    if cfg.config_file:
        config = TransNormerConfig.from_json_file(cfg.config_file)
        if cfg.task == "clm":  # the file's own limit, raised only to the run's length (it had been
            # overwritten with max(seq_len, 512): learned positions of 2048 trained and saved as 512;
            # a run saved under those rules resumes under them)
            overrides.setdefault("max_position_embeddings", max(config.max_position_embeddings, cfg.seq_len)
                                 if current_model_rules() >= 2 else max(cfg.seq_len, 512))
        for k, v in {**overrides, **extra}.items():
            setattr(config, k, v)
    else:
        if cfg.task == "clm":
            overrides.setdefault("max_position_embeddings", max(cfg.seq_len, 512))
        config = get_config(cfg.preset, **overrides, **extra)
    check_model_fits(config, cfg, vocab_size)
    return config


def init_config(init: Path, cfg: TrainConfig, vocab_size: int, num_labels: int | None):
    """The config of a run that starts from the weights in ``init``: the saved config with the run's
    overrides (only INIT_FROM_OVERRIDES, TrainConfig.check) and label count, checked against the run
    before any weight loads."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(init)
    archs = config.architectures or []
    if num_labels and num_labels != config.num_labels and any("SequenceClassification" in a for a in archs):
        # (one output is a regression on real-valued scores, HF's rule)
        model = "regression (one output)" if config.num_labels == 1 else f"{config.num_labels} classes"
        data = "real-valued scores" if num_labels == 1 else f"{num_labels} classes"
        raise ValueError(f"{init} is a model of {model} and the data has {data}: "
                         "evaluate it on data of its kind; to fine-tune it on other labels, start from its "
                         "encoder: AutoModel.from_pretrained(it).save_pretrained(dir) saves it without the head, and "
                         "--init-from dir gives the run a new one")
    for k, v in {**({"num_labels": num_labels} if num_labels else {}), **cfg.overrides}.items():
        setattr(config, k, v)
    check_model_fits(config, cfg, vocab_size)
    return config


def name_classes(model, label_set) -> None:
    """The data's label names in the model's config (``id2label``, which checkpoints keep and
    pipelines print); for a model that names its classes already, a check that the data's are the
    same in the same order, since a class index means nothing else (a change in how labels are read
    would otherwise swap a trained classifier's classes silently). Real-valued scores (``Scores``) make
    the model a regressor (``problem_type="regression"``, which its checkpoints keep)."""
    if label_set is None:
        return
    from ..data.classification import Scores

    if isinstance(label_set, Scores):  # a regression task (STS-B): one output, scored by MSE
        if model.config.problem_type not in (None, "regression"):
            raise ValueError(f"the data's labels are real-valued scores, and the model is a "
                             f"{model.config.problem_type} classifier: evaluate or train it on data with class labels")
        model.config.problem_type = "regression"
        return
    config, names = model.config, list(label_set.names)
    if config.problem_type not in (None, "single_label_classification"):
        # (--set problem_type=regression on class labels had failed at the first step, naming label shapes)
        raise ValueError(f"the data's labels are classes {names[:10]}, and the model's problem_type is "
                         f"{config.problem_type!r}: the labels decide it (real-valued scores, some not whole, make "
                         "a regression); leave problem_type out (--set problem_type)")
    saved = [config.id2label.get(i) for i in range(len(config.id2label or {}))]
    if saved and saved != [f"LABEL_{i}" for i in range(len(saved))] and saved != names:
        raise ValueError(f"the model's classes are {saved} (in index order) and the data's {names}: evaluate "
                         "or train it on data with the same labels")
    config.id2label = dict(enumerate(names))
    config.label2id = {n: i for i, n in enumerate(names)}


def build_model_for(cfg: TrainConfig, vocab_size: int, num_labels: int | None, special_ids: dict):
    """The model named by the config (preset, config file, or a pretrained directory)."""
    from ..presets import build_model

    if cfg.init_from:
        import transformers

        head = {"clm": "CausalLM", "mlm": "MaskedLM", "cls": "SequenceClassification"}[cfg.task]
        init = resolve_model_dir(cfg.init_from, what="init_from")  # a run directory works too
        config = init_config(init, cfg, vocab_size, num_labels)
        return getattr(transformers, f"AutoModelFor{head}").from_pretrained(init, config=config)
    return build_model(model_config_for(cfg, vocab_size, num_labels, special_ids), task=cfg.task)


def micro_weights(micro_batches: list[dict], task: str, info: DistInfo) -> list[float] | None:
    """What each micro-batch's mean loss is multiplied by before its backward.

    1 / grad_accum, except for MLM, whose micro-batches hold different numbers of masked tokens:
    there each weighs in by its share of the step's masked tokens over all ranks (n_i · W / N; DDP
    then averages over the W ranks), so the gradient is that of the mean over every masked token of
    the global batch, whatever the split into ranks and accumulation steps. None (on every rank)
    where the step masks nothing at all: it has no loss and no gradient."""
    if task != "mlm":
        return [1.0 / len(micro_batches)] * len(micro_batches)
    counts = [int((b["labels"] != -100).sum()) for b in micro_batches]
    (total,) = all_reduce_sum([float(sum(counts))], info)
    return [c * info.world_size / total for c in counts] if total else None


# What a run leaves in its out_dir besides checkpoints/ (train_config.json is rewritten at the start;
# lra_result.*: `lra train`'s result, which `lra report` would read as a new run's when that diverges)
RUN_FILES = ("metrics.jsonl", "grad_norms.jsonl", "summary.json", "train_config.json", "loss.png",
             "grad_rsd.json", "grad_norms.png", "tensorboard", "lra_result.json", "lra_result.md")


# TrainConfig fields and the `transnormer train` flags that set them (for check()'s messages)
_FLAGS = {name: "--" + name.replace("_", "-") for name in (
    "task", "preset", "data", "tokenizer", "vocab_size", "cache_dir", "mlm_packing", "seq_len", "batch_size",
    "grad_accum", "max_steps", "budget", "lr", "min_lr_ratio", "warmup", "warmup_init_lr", "schedule",
    "weight_decay", "betas", "adam_eps", "clip", "dtype", "strategy", "device", "seed", "eval_every",
    "eval_batches", "save_every", "keep_last", "init_from")} | {"out_dir": "--out", "config_file": "--config",
                                                                 "overrides": "--set", "no_truncate": "--no-truncate"}

RUN_LOCK = ".transnormer-run.lock"  # held by the run training in an out_dir (train)


def real_tokens(batch: dict) -> int:
    """The tokens a batch holds: its attention masks' ones (padding is no token), else every id.
    ``tokens`` counts batch x seq_len positions a step (what budgets count), which for classification
    batches (padded to their longest example) and whole-sentence MLM blocks is more than there are."""
    masks = [v for k, v in batch.items() if k.startswith("attention_mask")]
    if masks:
        return sum(int(m.sum()) for m in masks)
    return sum(v.numel() for k, v in batch.items() if k.startswith("input_ids"))


def start_fresh(out: Path, log=print) -> None:
    """A run that does not resume owns ``out`` from step 0: an earlier run's checkpoints and its
    files (metrics, summary, plots, gradient statistics) are moved into
    ``checkpoints/earlier-run-*/``: kept, but out of reach of resume and pruning, where their higher
    steps would shadow this run's, and of this run's curves, which they would mix with. (Its
    gradient statistics and plots had stayed beside a new run that recorded none.)"""
    root = out / "checkpoints"
    old = list_checkpoints(root) + ([root / "latest"] if (root / "latest").exists() else [])
    files = [out / name for name in RUN_FILES if (out / name).exists()]
    if not (old or files):
        return
    aside = root / f"earlier-run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    aside.mkdir(parents=True)
    for p in old + files:
        os.replace(p, aside / p.name)
    log(f"{out} held an earlier run: moved its checkpoints and files to {aside} (--resume continues a run)")


class _StopRequests:
    """SIGINT (Ctrl-C) and SIGTERM (a job's time limit) during training set a flag that the loop
    reads at the end of a step, which it then saves before it stops: without --save-every a Ctrl-C
    had left nothing to resume. A second signal stops at once, as without this."""

    def __init__(self):
        self.requested, self._previous = False, {}
        if threading.current_thread() is threading.main_thread():  # (signal handlers live there only)
            for sig in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(sig) is not signal.SIG_IGN:  # (a background job ignores Ctrl-C: still)
                    self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.requested:
            self.restore()
            signal.raise_signal(signum)
            return
        self.requested = True

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def param_groups(model, weight_decay: float, *, decay_all: bool = False, by_name: bool = True):
    """No weight decay on 1-D parameters (biases, norm gains, LRPE θ, scalars) and on those a module
    names in ``no_weight_decay`` (GAU/FLASH's per-head γ and β, a gain and a bias of shape [heads, s]),
    the common choice; ``decay_all``: on every parameter, as fairseq's Adam (which the paper trained with) does.
    ``by_name=False``: by shape alone, the grouping of runs saved before ``no_weight_decay`` (γ, β decayed)."""
    named = {id(getattr(m, n)) for m in model.modules() for n in getattr(m, "no_weight_decay", ())} if by_name else set()
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            matrix = p.dim() >= 2 and id(p) not in named
            (decay if decay_all or matrix else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _group_sizes(optimizer_state: dict) -> list[int]:
    return [len(g["params"]) for g in optimizer_state["param_groups"]]


def autocast_factory(device: torch.device, dtype: str):
    """A zero-argument context factory: bf16 autocast on ``device`` when ``dtype == "bf16"``
    (with a warning on a CPU without bf16 products, where it is far slower than fp32)."""
    if dtype == "bf16" and device.type == "cpu" and not cpu_has_bf16_products():
        warnings.warn("dtype bf16 on a CPU without AVX512-BF16 or AMX: PyTorch multiplies bf16 matrices "
                      "hundreds of times slower than fp32 there; use dtype fp32 (--dtype fp32)", stacklevel=2)
    return lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16")


_RUNNING_STATS = ("running_mean", "running_var", "num_batches_tracked")


def running_statistics(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The batch norms' running statistics of this rank's copy of the model, by buffer name (CPU copies)."""
    return {name: buf.detach().cpu().clone() for name, buf in model.named_buffers()
            if name.rsplit(".", 1)[-1] in _RUNNING_STATS}


@torch.no_grad()
def load_running_statistics(model: torch.nn.Module, stats: dict[str, torch.Tensor]) -> None:
    for name, buf in model.named_buffers():
        if name in stats:
            buf.copy_(stats[name].to(buf.device))


def peak_memory_mb(info: DistInfo) -> float:
    if info.device.type == "cuda":
        return torch.cuda.max_memory_allocated(info.device) / 2**20
    return peak_rss_mb()


def _run_dir_holding(path: Path) -> Path | None:
    """The run directory whose ``checkpoints/`` folder, or one checkpoint in it, ``path`` is; else None."""
    if path.parent.name == "checkpoints" and (path / STATE).is_file():
        return path.parent.parent
    if path.name == "checkpoints" and path.is_dir() and (
            (path / "latest").is_file() or any(p.name.startswith("step-") for p in path.iterdir())):
        return path.parent
    return None


def train(cfg: TrainConfig) -> dict:
    """Train as ``cfg`` says (see TrainConfig); the run's summary. One run at a time per out_dir: a
    second started on the same folder is refused (it had moved the first's files aside and deleted the
    checkpoint it was writing)."""
    cfg.check()
    out = Path(cfg.out_dir)
    run_dir = _run_dir_holding(out)  # (refused before the lock: no lock file left in a checkpoint folder)
    if run_dir is not None:  # (a resume there found no checkpoint and trained a new run inside the old one)
        raise ValueError(f"out_dir (--out) {str(out)!r} is a run's checkpoint folder; give the run directory "
                         f"{str(run_dir)!r} (--resume finds its newest checkpoint there)")
    if int(os.environ.get("RANK", "0")) != 0:
        return _train(cfg)
    # The lock lives in the folder itself: keyed in the cache, two runs given different caches had
    # shared one out_dir. Best effort: a folder that cannot be made fails in _train, by name.
    made = not out.exists()
    try:
        with held_alone(out / RUN_LOCK, f"out_dir {cfg.out_dir!r}"):
            return _train(cfg)
    finally:  # a run refused before it wrote anything leaves no folder behind for its lock
        if made and out.is_dir() and {p.name for p in out.iterdir()} <= {RUN_LOCK}:
            with contextlib.suppress(OSError):
                (out / RUN_LOCK).unlink(missing_ok=True)
                out.rmdir()


def _train(cfg: TrainConfig) -> dict:  # (cfg checked by train)
    info = setup_distributed(cfg.device)
    check_strategy(info, cfg.strategy)  # before any data or model work
    # this run's peak, not an earlier run's in the same process (compare under torchrun, ablation)
    if info.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(info.device)
    else:
        reset_peak_rss()
    if cfg.grad_stats and is_sharded(info, cfg.strategy):  # its norms would be each rank's shard's
        raise ValueError("grad_stats (--grad-stats) needs whole gradients: use strategy 'ddp'")
    out = Path(cfg.out_dir)
    ckpt_root = out / "checkpoints"
    log = print if info.is_main else (lambda *a, **k: None)
    if info.is_main:  # before any data or model work: a run must not train only to fail at its first save
        try:  # (nothing created: a run refused later had left an empty checkpoints/ behind)
            check_output(ckpt_root, "out_dir", directory=True)
        except ValueError as e:
            raise ValueError(f"out_dir {str(out)!r} cannot hold checkpoints: {e}") from e
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)

    autocast = autocast_factory(info.device, cfg.dtype)
    ckpt = None
    if cfg.resume:
        # rank 0 first: finding the checkpoint may repair a save a kill interrupted (renames), which
        # two ranks must not do at once; the others then find the repaired folder
        ckpt = main_first(info, lambda: latest_valid_checkpoint(ckpt_root, log=log))
        found = gather_objects(None if ckpt is None else ckpt.name, info)
        if len(set(found)) > 1:  # (--out on storage a rank does not share: it would start at step 0 and hang)
            raise ValueError(f"resume: the processes found different checkpoints under {ckpt_root} (by rank: "
                             f"{found}); --out must be on storage every process sees")
        if ckpt is None:
            log(f"resume: no valid checkpoint under {ckpt_root}, starting from scratch")
    # data → model → optimizer
    # A run directory given as init_from is resolved (and its newest checkpoint verified) once, here,
    # for both the tokenizer and the weights; the saved config keeps what the user gave. A resumed
    # fine-tune builds from its own checkpoint, which holds the config, weights and tokenizer: the
    # model it started from may have moved since (resuming had failed then).
    init = (ckpt if ckpt is not None else resolve_model_dir(cfg.init_from, what="init_from")) if cfg.init_from else None
    build_cfg = replace(cfg, init_from=str(init)) if init is not None else cfg
    data = build_task_data(build_cfg, info, autocast)
    data.train.state_dict()  # the training batches are made at first use: a split too small fails here
    factory = data.extra.get("model_factory", build_model_for)  # e.g. the two-tower model of LRA Retrieval
    # a checkpoint made before the model-config rules changed (models/presets.py MODEL_RULES) holds a
    # model those rules built: it resumes under them (its layer_options, its --config positions)
    saved_state = None if ckpt is None else load_trainer_state(ckpt, verify=False)  # latest_valid_checkpoint verified it
    rules = MODEL_RULES if saved_state is None else (saved_state.get("model_rules") or 1)
    with model_rules(rules):
        model = factory(build_cfg, data.tokenizer.vocab_size, data.num_labels, special_token_ids(data.tokenizer))
    if ckpt is not None and data.extra.get("label_set") is not None:  # a preset's model names no classes:
        # the checkpoint's do, and the data must have them in the same order
        saved = json.loads((ckpt / "config.json").read_text()).get("id2label") or {}
        model.config.id2label = {int(k): v for k, v in saved.items()} or model.config.id2label
    name_classes(model, data.extra.get("label_set"))
    model = model.to(info.device)
    if info.rank:  # the same initial weights on every rank (above); from here each rank draws its own
        # dropout masks (the same seed had given every replica the same ones). Rank 0 keeps the
        # stream a single process has.
        torch.manual_seed(cfg.seed + 1_000_003 * info.rank)
    n_params = sum(p.numel() for p in model.parameters())
    if cfg.gradient_checkpointing:
        model.activation_checkpointing_enable()
    tokens_per_step = data.tokens_per_step * cfg.grad_accum * info.world_size
    budget_kind, budget = parse_budget(cfg.budget) if cfg.budget else ("steps", None)
    # max_steps and a budget together: whichever comes first ends the run (a time budget stops the
    # loop below; the schedule then follows max_steps)
    total_steps = cfg.max_steps
    if budget_kind == "tokens":
        total_steps = min(total_steps or math.inf, max(1, math.ceil(budget / tokens_per_step)))
    sched = {"kind": cfg.schedule, "warmup": cfg.warmup, "total_steps": total_steps or _UNFITTED,
             "min_lr_ratio": cfg.min_lr_ratio, "warmup_init_ratio": cfg.warmup_init_lr / cfg.lr, "cosine_lag": 1}
    if ckpt is None and total_steps is not None and total_steps <= cfg.warmup:  # (a time budget: once fitted)
        log(f"the run has {total_steps} steps, no more than warmup={cfg.warmup}: the learning rate will not "
            "finish warming up (give a smaller --warmup)")

    # resume (the optimizer's and scheduler's states once they exist, after wrap_model below)
    step, tokens_seen, real_seen, elapsed = 0, 0, 0, 0.0
    resumed, state = False, None
    peak_before = 0.0  # peak memory of the processes before a resume, MB

    def peak_mb() -> float:  # the run's peak memory so far, across its resumes, MB
        return max(peak_before, peak_memory_mb(info))

    # an evaluation due at the step a Ctrl-C / SIGTERM stopped: saved as pending and run first
    # thing on resume (the resumed run starts after that step and had never made it up)
    eval_pending = False
    if ckpt is not None:
        state, saved_state = saved_state, None
        changed = config_changes(state.get("config", {}), cfg)
        if changed:
            raise ValueError(f"resume: this run's settings differ from those of {ckpt} ({'; '.join(changed)}); "
                             "resume with the original settings, or start a new run (--init-from for weights)")
        try:  # the data first: other data can mean another vocabulary, which the weights would only
            # report as a size mismatch
            data.train.load_state_dict(state["data"])
        except ValueError as exc:  # (its words had named neither the flags nor the resume)
            raise ValueError(f"resume: {exc}; the data order was saved for the run's data, --seq-len and "
                             "--batch-size x processes: resume with those") from None
        # the model's own config too (after the data's check, whose words name a changed vocabulary
        # better): an edited --config file, the same path, had rebuilt another model that the weights
        # still fitted (activation, dropout, norm, LRPE options), and it trained on as that
        changed = model_config_changes(model, ckpt)
        if changed:
            raise ValueError(f"resume: the model differs from the one saved in {ckpt} ({'; '.join(changed)}); "
                             "resume with the original --config / --set, or start a new run (--init-from)")
        load_model_weights(model, ckpt)  # every rank the whole model: FSDP shards it in wrap_model
        sched.update({"cosine_lag": 0, **state["sched"]})  # (a run saved before the cosine read one update back)
        per_rank = state.get("rng_per_rank")
        # the same world size: each rank its own state; otherwise (or an older checkpoint) rank 0's,
        # and the other ranks a stream of their own from it, as at the start (the same state on every
        # rank would give every replica the same dropout masks again)
        own = bool(per_rank) and len(per_rank) == info.world_size and (
            info.world_size == 1 or not all(torch.equal(r["torch"], per_rank[0]["torch"]) for r in per_rank[1:]))
        set_rng_state(per_rank[info.rank] if own else state["rng"], info.device)
        if not own and info.rank:
            torch.manual_seed(cfg.seed + 1_000_003 * info.rank + state["step"])
        step, tokens_seen, elapsed = state["step"], state["tokens"], state["elapsed"]
        eval_pending = bool(state.get("eval_pending"))
        peak_before = state.get("peak_mem_mb", 0.0)  # (a finished run resumed trains nothing)
        real_seen = state.get("real_tokens")  # None: a checkpoint from before the count
        total_steps = state["total_steps"]
        if info.is_main:
            # The interrupted run logged its last step's train record wherever it fell; the run that goes
            # on would not have, unless that step is on its logging grid (before a resume that changes
            # --log-every: on either run's). A finished run keeps it: nothing logs it again. A pending
            # evaluation is made up below, and its record written again (an earlier resume from this
            # checkpoint, killed before its next, may have written it already).
            every = (state["config"].get("log_every", cfg.log_every), cfg.log_every)
            # (a spent time budget too: its run has no total_steps, and the record had been dropped)
            finished = (total_steps is not None and step >= total_steps) or (
                budget_kind == "seconds" and elapsed >= budget)
            off_grid = step != 1 and all(step % n for n in every)
            redo = ("train",) * (off_grid and not finished) + ("eval",) * eval_pending
            truncate_metrics(out / "metrics.jsonl", step, redo)
            truncate_metrics(out / "grad_norms.jsonl", step)
        log(f"resumed from {ckpt} at step {step}")
        resumed = True
    if info.is_main and not resumed:
        start_fresh(out, log if not cfg.resume else (lambda m: log(m.replace(" (--resume continues a run)", ""))))

    recorder = None
    if cfg.grad_stats:
        from ..analysis.grad_stats import GradientRecorder

        # ‖∇‖ over attention-module parameters, every step, into grad_norms.jsonl (continued on resume)
        recorder = GradientRecorder("mixer", jsonl_path=out / "grad_norms.jsonl" if info.is_main else None,
                                    resume=resumed)
        if resumed and recorder.steps and recorder.steps[-1] < step:
            log(f"warning: grad_norms.jsonl ends at step {recorder.steps[-1]}; steps {recorder.steps[-1] + 1}-{step} "
                "trained without --grad-stats, so the RSD's step range has a gap (summary: missing_steps)")
    if cfg.compile:
        model = torch.compile(model)
    wrapped = wrap_model(model, info, cfg.strategy, sync_batch_norm=cfg.sync_batch_norm)
    # The optimizer after wrap_model: FSDP replaces the parameters by sharded ones, and an optimizer
    # made before would step the old ones (which get no gradient). fused: one kernel per parameter
    # group instead of a dozen ops with temporaries (CPU: 3.3x faster measured on a 36M model); not
    # for FSDP's DTensors.
    sharded = is_sharded(info, cfg.strategy)
    groups = param_groups(model, cfg.weight_decay, decay_all=cfg.weight_decay_all)
    if resumed and _group_sizes(state["optimizer"]) != _group_sizes({"param_groups": groups}):
        # a run saved before GAU/FLASH's γ and β left the decayed group continues as it started
        groups = param_groups(model, cfg.weight_decay, decay_all=cfg.weight_decay_all, by_name=False)
        log("resume: this run decays GAU/FLASH's gamma and beta, as it did when it started")
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.adam_eps, fused=not sharded)
    scheduler = make_scheduler(optimizer, sched)  # reads `sched` live: a time budget sets total_steps later
    if resumed:
        load_optimizer_state(model, optimizer, state["optimizer"], info, cfg.strategy)
        scheduler.load_state_dict(state["scheduler"])
        own_stats = state.get("running_stats_per_rank")
        if own_stats and len(own_stats) == info.world_size:  # after wrap_model: DDP broadcasts rank 0's there
            load_running_statistics(unwrap(model), own_stats[info.rank])
        state = None  # (the optimizer state's tensors are the optimizer's now)
    metrics = MetricsLogger(out / "metrics.jsonl", enabled=info.is_main, purge_step=step + 1 if resumed else None)
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "train_config.json", json.dumps(asdict(cfg), indent=1, default=str))
    log(f"{run_name(cfg)}: {n_params / 1e6:.2f}M parameters, task {cfg.task}, "
        f"{tokens_per_step} tokens/step, world size {info.world_size}, {cfg.dtype}")

    saved_step = None

    def checkpoint():
        nonlocal saved_step
        saved_step = step
        # FSDP: the whole model and optimizer state gathered to rank 0 (every rank takes part)
        weights, optimizer_state = full_state(model, optimizer, info, cfg.strategy)
        state = {"step": step, "tokens": tokens_seen, "real_tokens": real_seen, "elapsed": elapsed,
                 "optimizer": optimizer_state,
                 "scheduler": scheduler.state_dict(), "sched": dict(sched), "data": data.train.state_dict(),
                 "rng": rng_state(info.device), "total_steps": total_steps, "config": asdict(cfg),
                 "eval_pending": eval_pending, "peak_mem_mb": peak_mb(), "model_rules": rules}
        # each rank's own generators: ranks draw different amounts (dropout on batches padded to
        # their own longest example), so rank 0's state is not the others'
        state["rng_per_rank"] = gather_objects(state["rng"], info)
        # and each rank's batch-norm statistics: the model's weights are rank 0's, but without synced
        # batch norm each rank keeps statistics of its own batches (FSDP never aligns them; DDP does
        # at the next training forward, after an evaluation made up on resume)
        stats = running_statistics(unwrap(model))
        if stats:
            state["running_stats_per_rank"] = gather_objects(stats, info)
        if recorder is not None:  # grad_norms.jsonl reaches at least the checkpoint's step
            recorder.flush()
        if info.is_main:
            save_checkpoint(ckpt_root, step, unwrap(model), state, tokenizer=data.tokenizer, keep_last=cfg.keep_last,
                            state_dict=weights)

    if data.eval_split != "valid":
        log(f"{cfg.data} has no validation split: evaluating on its {data.eval_split} split")

    def evaluate(split=data.eval_split):  # the task's split: a cls dataset may have no dev file
        # Without synced batch norm each rank's running statistics are its own batches' (FSDP never
        # aligns them, DDP at its next training forward), and each rank scored its share of the split
        # with them: a result of no one model. Evaluate rank 0's, which the checkpoint holds, and give
        # each rank its own back for training.
        own = running_statistics(unwrap(model)) if info.enabled else {}
        broadcast_buffers(unwrap(model), own, info)
        res = data.evaluate(unwrap(model), split, cfg.eval_batches)
        load_running_statistics(unwrap(model), own)
        metrics.log({"kind": "eval", "step": step, "split": split, "tokens": tokens_seen, "elapsed": elapsed, **res})
        return res

    if info.device.type == "cpu":  # the kernels' first-use build (seconds) must not count as training time
        build_cpu_kernels()
    model.train()
    bar = None
    if info.is_main and cfg.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total_steps, initial=step, unit="step", dynamic_ncols=True)
    last_eval, last_eval_step = None, None
    start_step = step
    first_dt, step_times = None, []  # this process's first step's time, and the others'
    # a time budget's schedule is fitted to the steps it will get, and refitted as steps double (a
    # resumed run keeps its fit until this process has a few steps of its own to refit from)
    fitting = total_steps is None and budget_kind == "seconds"
    next_fit = 1 if sched["total_steps"] == _UNFITTED else 4
    diverged_at = None
    record = None  # the last step's train record when log_every skipped it
    next_eval_s = cfg.eval_every_s * (1 + int(elapsed // cfg.eval_every_s)) if cfg.eval_every_s else None
    if eval_pending:
        last_eval, last_eval_step, eval_pending = evaluate(), step, False
    stop = _StopRequests()  # Ctrl-C / SIGTERM: the current step finishes, is saved, and the run stops
    try:
        while True:
            if total_steps is not None and step >= total_steps:
                break
            if budget_kind == "seconds" and elapsed >= budget:
                break
            t0 = time.perf_counter()
            loss_sum = 0.0
            micro_batches = [next(data.train) for _ in range(cfg.grad_accum)]
            real = sum(real_tokens(b) for b in micro_batches)
            weights = micro_weights(micro_batches, cfg.task, info)
            # an MLM step that masks nothing (short sequences, small batches) has no loss: nothing to learn,
            # and AdamW would still move the weights on its momentum and decay them. It counts as a step
            # (data and schedule move on) but updates nothing, and its record has no loss.
            no_targets = weights is None
            for micro, (batch, weight) in enumerate(zip(micro_batches, weights or [], strict=False)):
                batch = {k: v.to(info.device) for k, v in batch.items()}
                sync = micro == cfg.grad_accum - 1 or not info.enabled
                ctx = contextlib.nullcontext() if sync or not hasattr(wrapped, "no_sync") else wrapped.no_sync()
                with ctx:
                    with autocast():
                        # no logits kept: the LM heads compute the loss chunk by chunk (modules/lm_loss.py)
                        loss = wrapped(**batch, return_logits=False, return_dict=True).loss
                    (loss * weight).backward()
                loss_sum += float(loss.detach()) * weight if weight else 0.0  # (an MLM micro-batch may mask nothing)
            if recorder is not None and not no_targets:  # before clipping: G_t is the raw gradient's norm (spec §10)
                recorder.record(unwrap(model), step + 1)  # numbered as metrics.jsonl numbers steps (from 1)
            grad_norm = global_value(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                                    cfg.clip if cfg.clip > 0 else float("inf")))
            if not no_targets:
                optimizer.step()
            lr = optimizer.param_groups[0]["lr"]  # the rate this step used (the scheduler moves it next)
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens_seen += tokens_per_step
            # One all-reduce: the loss over ranks, and one clock for all of them (the mean step time), so
            # that time budgets, timed evaluations and the schedule fitted to a budget agree across ranks.
            loss_val, dt, real, stopping = all_reduce_sum([loss_sum, time.perf_counter() - t0, float(real),
                                                           float(stop.requested)], info)
            loss_val, dt, real = loss_val / info.world_size, dt / info.world_size, int(real)
            if no_targets:
                loss_val = None
            real_seen = None if real_seen is None else real_seen + real
            elapsed += dt  # training time only: evaluation and checkpoints do not eat the budget
            if first_dt is None:
                first_dt = dt
            else:
                step_times.append(dt)
            if fitting and step >= SCHEDULE_FIT_STEP and len(step_times) >= next_fit:
                next_fit = 2 * len(step_times)
                total_steps_est = fit_total_steps(step, elapsed, budget, step_times)
                if sched["total_steps"] == _UNFITTED:  # the first fit: no decay has happened yet
                    if total_steps_est <= cfg.warmup:
                        log(f"the {cfg.budget} budget gives about {total_steps_est} steps, no more than "
                            f"warmup={cfg.warmup}: the learning rate will not finish warming up (give a smaller --warmup)")
                    sched["total_steps"] = total_steps_est
                else:  # a refit continues the decay from where it stands (an lr that never rises)
                    refit(sched, total_steps_est, step)
                if bar is not None:  # now the bar can show an ETA
                    bar.total = total_steps_est
                    bar.refresh()
            record = {"kind": "train", "step": step, "loss": loss_val, "lr": lr, "grad_norm": float(grad_norm),
                      **({"no_targets": True} if no_targets else {}),
                      "tokens": tokens_seen, "tokens_per_s": tokens_per_step / dt, "real_tokens": real_seen,
                      "real_tokens_per_s": real / dt, "elapsed": elapsed, "peak_mem_mb": peak_memory_mb(info)}
            if step % cfg.log_every == 0 or step == 1:
                metrics.log(record)
                record = None
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss="—" if loss_val is None else f"{loss_val:.3f}", tok_s=f"{tokens_per_step / dt:.0f}")
            # a non-finite gradient has just made the weights non-finite too (the optimizer applied it)
            if not ((loss_val is None or math.isfinite(loss_val)) and math.isfinite(float(grad_norm))):
                log(f"step {step}: loss {loss_val}, gradient norm {float(grad_norm)}: the run diverged; stopping "
                    "without saving these weights (the checkpoints before them are kept)")
                diverged_at = step
                break
            if (cfg.eval_every and step % cfg.eval_every == 0) or (next_eval_s is not None and elapsed >= next_eval_s):
                if stopping:  # interrupted: save first, evaluate on resume
                    eval_pending = True
                else:
                    last_eval, last_eval_step = evaluate(), step
                if next_eval_s is not None:
                    next_eval_s = cfg.eval_every_s * (1 + int(elapsed // cfg.eval_every_s))
            if cfg.save_every and step % cfg.save_every == 0:
                checkpoint()
            if stopping and saved_step != step:  # any rank's Ctrl-C / SIGTERM: every rank saves this whole step
                checkpoint()
            if stopping or (cfg.stop_after is not None and step >= cfg.stop_after):
                if bar is not None:
                    bar.close()
                if recorder is not None:
                    recorder.flush()
                if stopping and record is not None:  # (stop_after stands for a kill: no last record)
                    metrics.log(record)
                metrics.close()
                cleanup(info)
                if stopping:
                    log(f"interrupted after step {step}, saved: the same command with --resume continues from it")
                    return {"interrupted_at": step}
                return {"stopped_at": step}
    finally:
        stop.restore()
    if bar is not None:
        bar.close()
    if record is not None:  # the last step is always logged: final_train_loss had been an earlier step's
        metrics.log(record)

    if diverged_at is not None:
        # No final checkpoint: its non-finite weights would be what --resume and --model find, and
        # keep_last would prune a good checkpoint for them. Nor an evaluation of them, and none of an
        # earlier step is reported as the run's (compare had tabulated one as if the run had finished).
        records = read_metrics(out / "metrics.jsonl") if info.is_main else []
        last_eval = None
    elif step == start_step and step > 0:  # resumed a finished run: its final checkpoint exists
        log(f"resume: the run already reached step {step}; nothing to train")
        records = read_metrics(out / "metrics.jsonl") if info.is_main else []
        evals = [r for r in records if r.get("kind") == "eval" and r["step"] == step]
        last_eval = ({k: v for k, v in evals[-1].items() if k not in ("kind", "step", "split", "tokens", "elapsed")}
                     if evals else None)
        # a kill between the final checkpoint and its evaluation: evaluate now (rank 0 read the
        # metrics; every rank takes part in the evaluation)
        (missing,) = all_reduce_sum([float(info.is_main and not evals)], info)
        if missing:
            last_eval = evaluate()
            records = read_metrics(out / "metrics.jsonl") if info.is_main else []
    else:
        if saved_step != step:  # the checkpoint first: a failing evaluation must not lose it
            checkpoint()
        if last_eval_step != step:  # the final model's evaluation, unless the last step just had one
            last_eval = evaluate()
        records = read_metrics(out / "metrics.jsonl") if info.is_main else []
    train_pts = [(r["step"], r["loss"]) for r in records if r.get("kind") == "train" and r["loss"] is not None]
    speeds = [r["tokens_per_s"] for r in records if r.get("kind") == "train" and r["step"] > 2]
    real_speeds = [r["real_tokens_per_s"] for r in records
                   if r.get("kind") == "train" and r["step"] > 2 and "real_tokens_per_s" in r]
    summary = {
        "name": run_name(cfg), "task": cfg.task, "params": n_params,
        "steps": step, "tokens": tokens_seen, "elapsed_s": elapsed,
        "tokens_per_s": float(np.median(speeds)) if speeds else tokens_seen / max(elapsed, 1e-9),
        "real_tokens": real_seen,  # the non-padding tokens trained on (None after an older checkpoint)
        "real_tokens_per_s": (float(np.median(real_speeds)) if real_speeds
                              else None if real_seen is None else real_seen / max(elapsed, 1e-9)),
        "peak_mem_mb": peak_mb(),
        "final_train_loss": train_pts[-1][1] if train_pts else None,
        "eval": last_eval, "dtype": cfg.dtype, "world_size": info.world_size, "data": cfg.data,
        "diverged_at": diverged_at,  # the step whose loss or gradient was not finite, else None
    }
    if data.extra.get("truncated"):  # cls: examples cut to seq_len, per split
        summary["truncated"] = data.extra["truncated"]
    if data.extra.get("train_record"):  # LRA: the training split's provenance, size and cut sequences
        summary["train_data"] = data.extra["train_record"]
    if recorder is not None and info.is_main:
        recorder.flush()
        recorder.save_summary(out / "grad_rsd.json")
        recorder.plot(out / "grad_norms.png")
        summary["grad_stats"] = recorder.summary()
    if info.is_main:
        eval_pts = [(r["step"], r["loss"]) for r in records if r.get("kind") == "eval"]
        plot_curves({"train": train_pts, "valid": eval_pts}, out / "loss.png", title=str(summary["name"]))
        atomic_write_text(out / "summary.json", json.dumps(to_jsonable(summary), indent=1))  # (NaN: null)
    metrics.close()
    cleanup(info)
    return summary

