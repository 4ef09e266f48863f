"""``gemzoo eval --checkpoint PATH``: the eval metrics of a checkpoint, without training.

    gemzoo eval --checkpoint runs/gem-tiny                       # newest valid checkpoint of a run folder
    gemzoo eval --checkpoint runs/gem-tiny/checkpoints/step-00000400 --split test --json out.json

The run is assembled from the config in the checkpoint's manifest (or ``--config F``, plus ``--set`` and
``--plugins``), its model weights are loaded, and the trainer's own ``Trainer.evaluate`` runs over
``eval.batches`` held-out batches: AUC and log loss per task for ``gem``, HR@K / NDCG@K / MRR for the retrieval
families. So the metrics equal what the training run logged at that step, for the same split.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import fields, is_dataclass
from pathlib import Path

import torch

from gemzoo.cli.plot import read_metrics
from gemzoo.config import load_config
from gemzoo.distributed.state import load_full_state
from gemzoo.errors import CheckpointError, ConfigError
from gemzoo.train import checkpoint as ckpt
from gemzoo.train.trainer import Trainer

SPLITS = ("val", "test")


def resolve_checkpoint(path: str | Path) -> dict:
    """Load a ``step-*`` checkpoint folder, or the newest valid one of a run folder or its ``checkpoints/``."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"--checkpoint {path} does not exist; give a run folder (run.out_dir), its "
                              "checkpoints/ folder or one checkpoints/step-* folder")
    if (path / "manifest.json").is_file() or ckpt.STEP_DIR.match(path.name):
        return ckpt.load_checkpoint(path)
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    state = ckpt.load_latest(root)
    if state is None:
        raise CheckpointError(f"--checkpoint {path}: no checkpoint under {root} (no step-* folder); was the run "
                              "trained with checkpoint.every = 0?")
    return state


def run_folder_of(checkpoint_dir: Path) -> Path:
    """``RUN/checkpoints/step-N`` -> ``RUN``; a loose checkpoint folder -> its parent."""
    parent = checkpoint_dir.parent
    return parent.parent if parent.name == "checkpoints" else parent


def set_split(data_cfg, split: str, source: str) -> None:
    """Point the dataset's held-out batches at ``split``. A dataset with one held-out stream serves only "val"."""
    if split not in SPLITS:
        raise ConfigError(f"--split {split!r}: choose one of {', '.join(SPLITS)}")
    has_split = is_dataclass(data_cfg) and any(f.name == "eval_split" for f in fields(data_cfg))
    if has_split:
        data_cfg.eval_split = split
    elif split != "val":
        raise ConfigError(f"dataset {source!r} has one held-out stream, evaluated as --split val; --split test "
                          "needs a dataset with an eval_split key (e.g. movielens)")


def evaluate_checkpoint(checkpoint: str | Path, *, config: str | None = None, overrides: list[str] | None = None,
                        plugins: str | None = None, split: str = "val", batches: int | None = None,
                        device: str | None = None) -> dict:
    """Assemble the run of ``checkpoint``, load its weights, evaluate. Returns a JSON-able summary."""
    state = resolve_checkpoint(checkpoint)
    manifest = state["manifest"]
    overrides = list(overrides or [])
    if batches is not None:
        overrides.append(f"eval.batches={batches}")
    if device is not None:
        overrides.append(f"run.device={json.dumps(device)}")
    if config:
        cfg = load_config(config, overrides=overrides, plugins=plugins)
    else:
        saved = manifest.get("config")
        if not isinstance(saved, dict):
            raise CheckpointError(f"{state['path']}/manifest.json records no config; pass --config F")
        cfg = load_config(raw=saved, overrides=overrides, plugins=plugins)
        cfg.source = f"{state['path']}/manifest.json"
    set_split(cfg.data, split, cfg.data.source)
    cfg.run.tensorboard = False
    scratch = Path(tempfile.mkdtemp(prefix="gemzoo-eval-"))  # assembly writes nothing; never the run folder
    try:
        trainer = Trainer(cfg, out_dir=str(scratch / "run"), progress=False).assemble()
        model_sd = trainer.model.state_dict()
        bad = [(k, tuple(v.shape), tuple(model_sd[k].size())) for k, v in state["model"].items()
               if k in model_sd and tuple(v.shape) != tuple(model_sd[k].size())]
        if bad:
            name, saved_shape, model_shape = bad[0]
            raise CheckpointError(f"{state['path']}: {name} is {saved_shape} in the checkpoint but {model_shape} "
                                  f"in the model of this config ({len(bad)} such tensors); evaluate with the "
                                  "config it was trained with (drop --config / --set)")
        missing, unexpected = load_full_state(trainer.model, state["model"])
        if missing or unexpected:
            raise CheckpointError(f"{state['path']} does not match this model: missing {missing[:5]}, unexpected "
                                  f"{unexpected[:5]}")
        torch.manual_seed(cfg.run.seed)
        metrics = trainer.evaluate()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {"checkpoint": str(state["path"]), "step": int(manifest["step"]), "split": split,
            "batches": cfg.eval.batches, "model": cfg.model.family, "dataset": cfg.data.source,
            "plugins": {"attention": cfg.plugins.attention, "precision": cfg.plugins.precision},
            "metrics": metrics}


def logged_eval(run_dir: str | Path, step: int) -> dict[str, float]:
    """The eval metrics ``metrics.jsonl`` of ``run_dir`` logged at ``step`` ({} if none)."""
    for row in read_metrics(run_dir):
        if row["step"] == step:
            return {k: v for k, v in row.items() if k.startswith("eval/")}
    return {}


# --------------------------------------------------------------------------------------------- CLI
def cmd_eval(args) -> int:
    result = evaluate_checkpoint(args.checkpoint, config=args.config, overrides=args.set, plugins=args.plugins,
                                 split=args.split, batches=args.batches, device=args.device)
    out = Path(args.json) if args.json else (
        run_folder_of(Path(result["checkpoint"])) / f"eval-step-{result['step']:08d}-{result['split']}.json")
    result["logged"] = logged_eval_or_empty(run_folder_of(Path(result["checkpoint"])), result["step"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({**result, "json": str(out)}))
    return 0


def logged_eval_or_empty(run_dir: Path, step: int) -> dict[str, float]:
    try:
        return logged_eval(run_dir, step)
    except ConfigError:  # no metrics.jsonl beside the checkpoint (copied elsewhere)
        return {}
