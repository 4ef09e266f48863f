"""Checkpoints: safetensors + a JSON manifest, written atomically; never unpickled.

Layout: ``<out_dir>/checkpoints/step-00000100/{model,optim,rng}.safetensors, manifest.json``.
A checkpoint is written into a temporary folder, every file fsynced, then renamed into place, so a
crash leaves either the old set or the new one. The manifest records each file's size and SHA-256;
loading verifies them, so truncation or corruption raises CheckpointError instead of loading junk.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from gemzoo.errors import CheckpointError

FORMAT_VERSION = 1
STEP_DIR = re.compile(r"^step-(\d{8})$")
FUSED_FILE = "optim-fused-tables.safetensors"  # optimizers fused into sharded tables


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def flatten_optimizer(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Optimizer state_dict -> (tensors for safetensors, JSON-able rest)."""
    tensors, meta = {}, {"param_groups": state["param_groups"], "state": {}}
    for pid, pstate in state["state"].items():
        meta["state"][str(pid)] = {}
        for key, value in pstate.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{pid}.{key}"] = value.detach().contiguous().cpu()
                meta["state"][str(pid)][key] = "tensor"
            else:
                meta["state"][str(pid)][key] = value
    return tensors, meta


def unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state = {}
    for pid, pstate in meta["state"].items():
        state[int(pid)] = {k: (tensors[f"{pid}.{k}"] if v == "tensor" else v) for k, v in pstate.items()}
    return {"state": state, "param_groups": meta["param_groups"]}


def rng_state() -> dict[str, torch.Tensor]:
    out = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"cuda{i}"] = s
    return out


def set_rng_state(tensors: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(tensors["torch"])
    if torch.cuda.is_available():
        cuda = [tensors[k] for k in sorted(k for k in tensors if k.startswith("cuda"))]
        if cuda:
            torch.cuda.set_rng_state_all(cuda)


def save_checkpoint(root: str | Path, step: int, *, model_state: dict[str, torch.Tensor],
                    optimizers: dict[str, dict], manifest: dict[str, Any], keep: int = 2,
                    fused_optimizer: dict[str, torch.Tensor] | None = None) -> Path:
    """Atomically write checkpoint ``step`` under ``root``; keep the newest ``keep`` ones.

    ``fused_optimizer``: whole tensors of optimizers fused into sharded tables (fused_optimizer_state)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    files = {"model.safetensors": {k: v.detach().contiguous().cpu() for k, v in model_state.items()}}
    optim_meta = {}
    for name, state in optimizers.items():
        tensors, meta = flatten_optimizer(state)
        files[f"optim-{name}.safetensors"] = tensors
        optim_meta[name] = meta
    if fused_optimizer:
        files[FUSED_FILE] = {k: v.detach().contiguous().cpu() for k, v in fused_optimizer.items()}
    files["rng.safetensors"] = rng_state()
    entries = {}
    for fname, tensors in files.items():
        path = tmp / fname
        save_file(_dedupe_storage(tensors), str(path))
        entries[fname] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    full_manifest = {"format": FORMAT_VERSION, "step": step, "files": entries, "optimizers": optim_meta, **manifest}
    with open(tmp / "manifest.json", "w") as f:
        json.dump(full_manifest, f, indent=1, default=str)
    mode = (tmp / "manifest.json").stat().st_mode & 0o777  # what the umask gives a new file (safetensors: 0600)
    for fname in files:
        os.chmod(tmp / fname, mode)
    for path in tmp.iterdir():
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    for old in list_checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _dedupe_storage(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors sharing storage (tied weights): clone the repeats."""
    seen, out = set(), {}
    for k, v in tensors.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset()) if v.numel() else None
        out[k] = v.clone() if key in seen else v
        if key is not None:
            seen.add(key)
    return out


def remove_stale_temporaries(root: str | Path) -> list[Path]:
    """Delete the ``.tmp-step-*`` folders that a crash inside ``save_checkpoint`` left behind.

    Call it when a run starts, before it writes any checkpoint: one run folder holds one run."""
    root = Path(root)
    stale = sorted(p for p in root.glob(".tmp-step-*") if p.is_dir()) if root.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def checkpoint_step(path: str | Path) -> int | None:
    m = STEP_DIR.match(Path(path).name)
    return int(m.group(1)) if m else None


def list_checkpoints(root: str | Path) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name))


SAFETENSORS_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]*\.safetensors$")
REQUIRED_FILES = ("model.safetensors", "rng.safetensors")
SHA256 = re.compile(r"^[0-9a-f]{64}$")


def validate_manifest(manifest: Any, path: str | Path) -> None:
    """Check a parsed manifest's schema; CheckpointError naming the first problem.

    File names must be plain ``*.safetensors`` names (no ``/`` or ``..``): a manifest never makes the
    loader read outside its own folder."""
    path = Path(path)

    def bad(problem: str) -> CheckpointError:
        return CheckpointError(f"{path / 'manifest.json'} {problem}; resume from an earlier checkpoint "
                               "(--resume picks the newest valid one)")

    if not isinstance(manifest, dict):
        raise bad(f"holds a JSON {type(manifest).__name__}, not an object")
    if manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format {manifest.get('format')!r} is not {FORMAT_VERSION}")
    step = manifest.get("step")
    if type(step) is not int or step < 0:
        raise bad(f"has step {step!r}, not a non-negative integer")
    if checkpoint_step(path) not in (None, step):
        raise bad(f"says step {step} but its folder is {path.name}")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise bad("has no files table")
    for fname, meta in files.items():
        if not SAFETENSORS_NAME.match(fname) or ".." in fname:
            raise bad(f"lists the file {fname!r}: only plain *.safetensors names inside the checkpoint folder")
        if not (isinstance(meta, dict) and type(meta.get("bytes")) is int and isinstance(meta.get("sha256"), str)
                and SHA256.match(meta["sha256"])):
            raise bad(f"gives no valid bytes and sha256 for {fname}")
    for fname in REQUIRED_FILES:
        if fname not in files:
            raise bad(f"lists no {fname}")
    optimizers = manifest.get("optimizers", {})
    if not isinstance(optimizers, dict):
        raise bad("has an optimizers entry that is not an object")
    for name, meta in optimizers.items():
        if f"optim-{name}.safetensors" not in files:
            raise bad(f"has state for optimizer {name!r} but lists no optim-{name}.safetensors")
        if not (isinstance(meta, dict) and isinstance(meta.get("param_groups"), list)
                and all(isinstance(g, dict) for g in meta["param_groups"]) and isinstance(meta.get("state"), dict)
                and all(isinstance(v, dict) for v in meta["state"].values())):
            raise bad(f"has malformed state for optimizer {name!r} (param_groups must be a list of objects, "
                      "state an object of objects)")
    if not isinstance(manifest.get("config", {}), dict):
        raise bad("has a config entry that is not an object")


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Verify and load one checkpoint folder. Raises CheckpointError naming the bad file."""
    path = Path(path)
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise CheckpointError(f"{path} has no manifest.json: not a gemzoo checkpoint, or it was never finished")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{manifest_path} is corrupt ({exc}); resume from an earlier checkpoint") from None
    validate_manifest(manifest, path)
    loaded = {}
    for fname, meta in manifest["files"].items():
        fpath = path / fname
        if not fpath.is_file():
            raise CheckpointError(f"{fpath} is missing; resume from an earlier checkpoint")
        size = fpath.stat().st_size
        if size != meta["bytes"]:
            raise CheckpointError(
                f"{fpath} is truncated or corrupt: {size} bytes, the manifest says {meta['bytes']}. "
                "Resume from an earlier checkpoint (--resume picks the newest valid one)."
            )
        if _sha256(fpath) != meta["sha256"]:
            raise CheckpointError(f"{fpath} fails its SHA-256 check; resume from an earlier checkpoint")
        try:
            loaded[fname] = load_file(str(fpath))
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{fpath} cannot be read as safetensors: {exc}") from None
    try:
        optimizers = {
            name: unflatten_optimizer(loaded[f"optim-{name}.safetensors"], meta)
            for name, meta in manifest.get("optimizers", {}).items()
        }
    except KeyError as exc:
        raise CheckpointError(f"{manifest_path} names optimizer state {exc} that its files do not hold; "
                              "resume from an earlier checkpoint") from None
    return {"manifest": manifest, "model": loaded["model.safetensors"], "optimizers": optimizers,
            "fused_optimizer": loaded.get(FUSED_FILE, {}), "rng": loaded["rng.safetensors"], "path": path}


def load_latest(root: str | Path) -> dict[str, Any] | None:
    """The newest checkpoint that verifies; corrupt newer ones are reported and skipped."""
    problems = []
    for path in reversed(list_checkpoints(root)):
        try:
            ckpt = load_checkpoint(path)
        except CheckpointError as exc:
            problems.append(str(exc))
            warnings.warn(f"skipping unusable checkpoint: {exc}", RuntimeWarning, stacklevel=2)
            continue
        ckpt["skipped"] = problems
        return ckpt
    if problems:
        raise CheckpointError("no usable checkpoint under " + str(root) + ": " + " | ".join(problems))
    return None


def load_resume_path(path: str | Path) -> dict[str, Any]:
    """``--resume PATH``: a run folder, its ``checkpoints/`` folder, or one ``step-*`` folder."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            f"--resume {path}: it does not exist. Give a run folder (e.g. runs/gem-tiny), its checkpoints/ folder "
            "or one step-* checkpoint folder, or plain --resume to continue the run in --out / run.out_dir")
    if checkpoint_step(path) is not None or (path / "manifest.json").exists():
        return load_checkpoint(path)
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    state = load_latest(root)
    if state is None:
        raise CheckpointError(f"--resume {path}: it holds no checkpoint (no {root}/step-* folder)")
    return state


def shape_mismatches(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> list[tuple[str, tuple, tuple]]:
    """(name, saved shape, model shape) for each saved tensor whose shape differs from the model's (whole) one."""
    out = []
    for name, value in model.state_dict().items():
        if name in full and tuple(full[name].shape) != tuple(value.size()):
            out.append((name, tuple(full[name].shape), tuple(value.size())))
    return out


def _is_sharded(t) -> bool:
    return hasattr(t, "local_shards") and hasattr(t, "gather")


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def gather_optimizer_state(state: dict) -> dict:
    """Optimizer state with FSDP2 DTensor entries made whole (collective on every rank)."""
    out = {"param_groups": state["param_groups"], "state": {}}
    for pid, pstate in state["state"].items():
        out["state"][pid] = {k: (v.full_tensor() if _is_dtensor(v) else v) for k, v in pstate.items()}
    return out


def redistribute_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """After loading whole tensors, shard each state entry like its FSDP2 parameter again."""
    from torch.distributed.tensor import distribute_tensor

    for p, pstate in opt.state.items():
        if not _is_dtensor(p):
            continue
        for k, v in pstate.items():
            if isinstance(v, torch.Tensor) and not _is_dtensor(v) and v.shape == p.shape:
                pstate[k] = distribute_tensor(v.to(p.dtype), p.device_mesh, p.placements)


def gather_full_state(state: dict[str, Any], is_main: bool) -> dict[str, torch.Tensor]:
    """Full tensors on the main rank for a state dict that may hold torchrec ShardedTensors.

    Every rank must call it (each ShardedTensor is gathered collectively); other ranks get {}.
    """
    full = {}
    for name, value in state.items():
        if _is_sharded(value):
            out = torch.empty(value.size(), dtype=value.dtype) if is_main else None
            value.gather(dst=0, out=out)
            value = out
        elif _is_dtensor(value):
            value = value.full_tensor()
        if is_main:
            full[name] = value
    return full


def _block(offsets, sizes) -> tuple[slice, ...]:
    """The index of one shard inside the whole tensor."""
    return tuple(slice(o, o + n) for o, n in zip(offsets, sizes))


def _copy_into_shards(sharded, full: torch.Tensor) -> None:
    """Copy this rank's pieces of the whole tensor ``full`` into a ShardedTensor's local shards."""
    for shard in sharded.local_shards():
        shard.tensor.copy_(full[_block(shard.metadata.shard_offsets, shard.metadata.shard_sizes)])


def fused_optimizer_state(model: torch.nn.Module) -> dict[str, Any]:
    """This rank's state of the optimizers fused into torchrec-sharded modules (the tables' Adagrad
    accumulators), keyed ``module/param/state``: ShardedTensors for the tables this rank stores."""
    out = {}
    for name, module in model.named_modules():
        fused = getattr(module, "fused_optimizer", None)  # torchrec's sharded collections
        if fused is None:
            continue
        for param, pstate in fused.state_dict()["state"].items():
            for key, value in pstate.items():
                if isinstance(value, torch.Tensor) or _is_sharded(value):
                    out[f"{name}/{param}/{key}"] = value
    return out


def gather_fused_optimizer_state(model: torch.nn.Module, is_main: bool) -> dict[str, torch.Tensor]:
    """Whole fused-optimizer tensors on the main rank, {} elsewhere; every rank must call it.

    Each rank's fused optimizer lists only the tables it stores, so the key sets differ between ranks and a
    per-key collective would not line up: local shards travel to rank 0 with their offsets instead."""
    import torch.distributed as dist

    pieces = []
    for name, value in fused_optimizer_state(model).items():
        if _is_sharded(value):
            pieces += [(name, tuple(value.size()), tuple(s.metadata.shard_offsets), s.tensor.detach().cpu())
                       for s in value.local_shards()]
        else:
            pieces.append((name, tuple(value.shape), (0,) * value.dim(), value.detach().cpu()))
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size() if is_main else None
        dist.gather_object(pieces, gathered, dst=0)
        pieces = [p for rank_pieces in gathered for p in rank_pieces] if is_main else []
    full = {}
    for name, size, offsets, tensor in pieces:
        whole = full.setdefault(name, torch.zeros(size, dtype=tensor.dtype))
        whole[_block(offsets, tensor.shape)] = tensor
    return full


@torch.no_grad()
def load_fused_optimizer_state(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> list[str]:
    """Copy whole saved tensors into the fused optimizers' state; returns the names it had no value for."""
    missing = []
    for name, value in fused_optimizer_state(model).items():
        if name not in full:
            missing.append(name)
        elif _is_sharded(value):
            _copy_into_shards(value, full[name])
        else:
            value.copy_(full[name])
    return missing


@torch.no_grad()
def load_full_state(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """Load full tensors into ``model``, copying into the local shards of sharded tables."""
    mismatched = shape_mismatches(model, full)
    if mismatched:
        raise CheckpointError("the checkpoint does not fit this model: " + "; ".join(
            f"{name} is {list(saved)} in the checkpoint but {list(own)} in the model" for name, saved, own in mismatched[:5]))
    own = model.state_dict()
    missing = [k for k in own if k not in full]
    unexpected = [k for k in full if k not in own]
    plain = {}
    for name, value in own.items():
        if name not in full:
            continue
        if _is_sharded(value):
            _copy_into_shards(value, full[name])
        elif _is_dtensor(value):
            from torch.distributed.tensor import distribute_tensor

            value.copy_(distribute_tensor(full[name].to(value.dtype), value.device_mesh, value.placements))
        else:
            plain[name] = full[name]
    result = model.load_state_dict(plain, strict=False)
    if result.unexpected_keys:  # a wrapper whose state_dict names differ from its load path
        raise CheckpointError(f"these saved tensors did not load into the model: {result.unexpected_keys[:5]}")
    return missing, unexpected
