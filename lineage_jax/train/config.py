"""Training configuration and the ``--set key=value`` override parser."""

from __future__ import annotations

import dataclasses
import importlib
import math
import numbers
import typing
from typing import Any, Sequence, Union

import numpy as np

from lineage_jax.memory._validate import is_int
from lineage_jax.models.config import ModelConfig, get_config


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    config: str = "tiny_gpt2"  # named model config
    steps: int = 100
    workdir: str = "runs/default"
    batch_size: int = 8
    seq_len: int = 128
    # Optimizer.
    optimizer: str = "adamw"  # "adamw" | "muon" (Muon on 2-D+ weights, per head for [.., H, d, ..] kernels; AdamW elsewhere)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    # MoE router-bias balancing (outside the optimizer).
    moe_bias_rule: str = "sign"  # "sign" | "quantile" | "none"
    moe_bias_rate: float = 1e-3
    # Data.
    data: str = "stdlib"  # "stdlib" | a directory of text files | a synthetic task name
    tokenizer: str = "byte"  # "byte" | "gpt2"
    seed: int = 0
    # Loop.
    log_every: int = 10
    eval_every: int = 0  # 0: only at the end
    eval_batches: int = 4
    save_every: int = 50
    keep_checkpoints: int = 2
    mesh: str = ""  # e.g. "data=2,expert=4" (see lineage_jax.parallel)
    # Multi-slice (TPU) / multi-node (GPU): how many slices or processes each mesh axis spans, e.g. "data=2";
    # `mesh` is then the shape within one slice or node (make_mesh's `dcn`).
    mesh_dcn: str = ""
    init_from_hf: str = ""  # a transformers checkpoint directory whose weights start the run (lineage_jax.hf)
    # Comma-separated Python modules imported before the model config is read, on every start and resume:
    # a module of the researcher's own that adds mixers (lineage_jax.models.register_rule).
    imports: str = ""
    progress: bool = True
    # Bitwise-reproducible steps on GPUs (XLA's deterministic ops: ordered scatter-adds and
    # reductions, no autotuning by timing); a few percent slower. CPUs are deterministic anyway.
    deterministic: bool = False

    def __post_init__(self):
        for f in ("progress", "deterministic"):  # a truthy string such as "false" must not read as True
            if not isinstance(getattr(self, f), (bool, np.bool_)):
                raise ValueError(f"TrainConfig.{f}: must be True or False, got {getattr(self, f)!r}")
        for f in ("config", "workdir", "optimizer", "moe_bias_rule", "data", "tokenizer", "mesh", "mesh_dcn",
                  "init_from_hf", "imports"):
            if not isinstance(getattr(self, f), str):
                raise ValueError(f"TrainConfig.{f}: must be a str, got {getattr(self, f)!r}")
        for f in ("config", "workdir", "data"):
            if not getattr(self, f).strip():
                raise ValueError(f"TrainConfig.{f}: must be a non-empty str, got {getattr(self, f)!r}")
        for f in ("steps", "batch_size", "seq_len", "log_every", "save_every", "eval_batches", "keep_checkpoints"):
            if not is_int(getattr(self, f)) or getattr(self, f) <= 0:
                raise ValueError(f"TrainConfig.{f}: must be a positive int, got {getattr(self, f)!r}")
        for f in ("warmup_steps", "eval_every"):
            if not is_int(getattr(self, f)) or getattr(self, f) < 0:
                raise ValueError(f"TrainConfig.{f}: must be an int >= 0, got {getattr(self, f)!r}")
        if not is_int(self.seed) or not 0 <= self.seed < 2**32:
            raise ValueError(f"TrainConfig.seed: must be an int in [0, 2**32), got {self.seed!r}")
        # (field, lowest, highest, highest included): NaN fails every comparison, so it is refused too.
        for f, lo, hi, hi_ok in (("lr", 0.0, math.inf, False), ("min_lr_ratio", 0.0, 1.0, True),
                                 ("weight_decay", 0.0, math.inf, False), ("b1", 0.0, 1.0, False),
                                 ("b2", 0.0, 1.0, False), ("grad_clip", 0.0, math.inf, False),
                                 ("moe_bias_rate", 0.0, math.inf, False)):
            v = getattr(self, f)
            ok = isinstance(v, numbers.Real) and not isinstance(v, bool) and lo <= v and (v <= hi if hi_ok else v < hi)
            if not ok or (f in ("lr", "grad_clip") and v == 0):
                need = {"lr": "finite and > 0", "grad_clip": "finite and > 0", "min_lr_ratio": "in [0, 1]",
                        "b1": "in [0, 1)", "b2": "in [0, 1)"}.get(f, "finite and >= 0")
                raise ValueError(f"TrainConfig.{f}: must be {need}, got {v!r}")
        if self.optimizer not in ("adamw", "muon"):
            raise ValueError(f"TrainConfig.optimizer: must be 'adamw' or 'muon', got {self.optimizer!r}")
        if self.moe_bias_rule not in ("sign", "quantile", "none"):
            raise ValueError(f"TrainConfig.moe_bias_rule: must be 'sign', 'quantile' or 'none', got {self.moe_bias_rule!r}")
        if self.tokenizer not in ("byte", "gpt2"):
            raise ValueError(f"TrainConfig.tokenizer: must be 'byte' or 'gpt2', got {self.tokenizer!r}")
        for name in module_names(self.imports):
            if not all(part.isidentifier() for part in name.split(".")):
                raise ValueError(f"TrainConfig.imports: {name!r} is not a module name (comma-separated dotted names)")


def module_names(imports: str) -> list[str]:
    """The module names of a ``TrainConfig.imports`` string."""
    return [name.strip() for name in imports.split(",") if name.strip()]


class ModuleImportError(ValueError):
    """A module named to be imported first failed to import: its ``module`` name and the ``cause``."""

    def __init__(self, module: str, cause: BaseException):
        self.module, self.cause = module, cause
        super().__init__(f"TrainConfig.imports: importing {module!r} failed ({type(cause).__name__}: {cause})")


def import_modules(imports: Union[str, Sequence[str]]) -> None:
    """Import the modules a ``TrainConfig.imports`` string (or a list of names: the experiments'
    ``--import``) names, in order; a :class:`ModuleImportError` naming the one that fails."""
    for name in module_names(imports) if isinstance(imports, str) else imports:
        try:
            importlib.import_module(name)
        except Exception as e:  # an ImportError or the module's own error: name the module either way
            raise ModuleImportError(name, e) from None


_TYPES = {"int": int, "float": float, "bool": bool, "str": str}


def _convert(name: str, raw: str, annotation: Any) -> Any:
    """Parse ``raw`` as the field's declared type (``int``, ``float``, ``bool``, ``str`` or
    ``Optional`` of one; the dataclasses' annotations are strings, read without ``eval``)."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    optional = text.startswith("Optional[") and text.endswith("]")
    if not isinstance(annotation, str) and typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional, text = True, getattr(args[0], "__name__", "str")
    elif optional:
        text = text[len("Optional["):-1]
    kind = _TYPES.get(text, str)
    if optional and raw.lower() in ("none", "null"):
        return None
    try:
        if kind is bool:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        return kind(raw)
    except ValueError:
        raise ValueError(f"--set {name}={raw}: expected a value of type {kind.__name__}") from None


def apply_overrides(train: TrainConfig, model: ModelConfig, pairs: list[str]) -> tuple[TrainConfig, ModelConfig]:
    """``["lr=1e-3", "d_model=128", ...]`` -> updated configs. Train fields win; then model fields."""
    train_fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    model_fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    t_changes, m_changes = {}, {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"--set expects key=value, got {pair!r}")
        key, raw = pair.split("=", 1)
        key = key.strip()
        model_only = key.startswith("model.")
        if model_only:
            key = key[len("model."):]
            table = model_fields if key in model_fields else {}
        else:
            table = train_fields if key in train_fields else model_fields
        if key not in table:
            import difflib

            valid = sorted(model_fields if model_only else set(train_fields) | set(model_fields))
            near = difflib.get_close_matches(key, valid, n=3, cutoff=0.6)
            if model_only and key in train_fields:
                raise ValueError(f"--set: unknown key 'model.{key}'; {key!r} is a TrainConfig field "
                                 f"(--set {key}=...), not a ModelConfig one")
            hint = f"did you mean {' or '.join(repr(n) for n in near)}?" if near else \
                "see the fields of TrainConfig (lineage_jax/train/config.py) and ModelConfig (lineage_jax/models/config.py)"
            raise ValueError(f"--set: unknown key {key!r}; {hint}")
        target = t_changes if table is train_fields else m_changes
        target[key] = _convert(key, raw.strip(), table[key].type)
    return dataclasses.replace(train, **t_changes), (model.replace(**m_changes) if m_changes else model)


def load_model_config(train: TrainConfig) -> ModelConfig:
    return get_config(train.config)
