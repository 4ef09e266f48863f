"""Checkpoints: safetensors + a JSON manifest, written atomically; never unpickled.

Layout: ``<out_dir>/checkpoints/step-00000100/{model,optim,rng}.safetensors, manifest.json``.
A checkpoint is written into a temporary folder, every file fsynced, then renamed into place, so a
crash leaves either the old set or the new one. A checkpoint whose parameters or optimizer state hold a NaN or
an infinity is never committed (``NonFiniteState``): every checkpoint a run leaves is one it can resume from. The manifest records each file's size and SHA-256;
loading verifies them, so truncation or corruption raises CheckpointError instead of loading junk.

This module is file IO only: it writes and reads whole tensors. Making sharded state whole (and putting it
back into shards) is ``gemzoo.distributed.state``'s job, and the planner's for its own state.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import struct
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from gemzoo.errors import CheckpointError, TrainingError

FORMAT_VERSION = 1
STEP_DIR = re.compile(r"^step-(\d{8})$")
PLANNER_FILE = "planner.safetensors"  # the planner's own state (Planner.state_dict), e.g. its tables' fused Adagrad
LEGACY_PLANNER_FILE = "optim-fused-tables.safetensors"  # the same, as checkpoints before 2026-12-01 name it
MANIFEST_HASH = "manifest_sha256"  # the manifest's own SHA-256 (of its canonical JSON without this key)
# Fault-injection tests only: seconds to pause between the tensor files and the manifest, the window in which
# a kill leaves a temporary folder and no new checkpoint.
PAUSE_ENV = "GEMZOO_TEST_CKPT_PAUSE_S"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def manifest_digest(manifest: dict) -> str:
    """SHA-256 of the manifest's canonical JSON (sorted keys), the ``manifest_sha256`` key left out."""
    body = {k: v for k, v in manifest.items() if k != MANIFEST_HASH}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class NonFiniteState(TrainingError):
    """The model or optimizer state holds a NaN or an infinity; no checkpoint of it is written."""


def _local_floating(t: Any) -> list[torch.Tensor]:
    """The floating-point data of ``t`` this process holds: a DTensor's local shard, a ShardedTensor's local
    shards (torchrec's tables), a plain tensor itself; nothing for integer tensors and non-tensors."""
    if hasattr(t, "local_shards"):
        parts = [s.tensor for s in t.local_shards()]
    elif hasattr(t, "to_local"):
        parts = [t.to_local()]
    else:
        parts = [t] if isinstance(t, torch.Tensor) else []
    return [p.detach() for p in parts if p.is_floating_point()]


def count_floating(named: dict[str, Any]) -> int:
    """How many of ``named`` are floating-point tensors (those ``nonfinite_tensors`` checks)."""
    return sum(1 for t in named.values() if _local_floating(t))


def nonfinite_tensors(named: dict[str, Any]) -> list[str]:
    """The names of the floating-point tensors that hold a NaN or an infinity. One fused max-norm reduction per
    (device, dtype) group and one read of its flags, so the check costs a pass over the state, not a sync per
    tensor. A sharded tensor is checked by its local shards (each rank checks its own)."""
    groups: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
    for name, t in named.items():
        for part in _local_floating(t):
            if part.numel():
                groups.setdefault((part.device, part.dtype), []).append((name, part))
    bad = []
    for items in groups.values():
        norms = torch._foreach_norm([t for _, t in items], float("inf"))
        flags = torch.isfinite(torch.stack([n.float() for n in norms])).tolist()
        bad += [name for (name, _), ok in zip(items, flags, strict=True) if not ok and name not in bad]
    return bad


def last_checkpoint_note(root: str | Path) -> str:
    """Where a stopped run can resume from: its newest checkpoint (every committed one is finite), or none."""
    found = list_checkpoints(root)
    if not found:
        return f"no checkpoint has been written in {root} yet"
    return f"the last checkpoint, {found[-1]}, holds finite state (resume from it with --resume)"


def nonfinite_state(step: int, bad: list[str], total: int, root: str | Path) -> NonFiniteState:
    """The error for ``bad`` (names such as ``model.x.weight``, ``optim-dense.3.exp_avg``) out of ``total``
    floating-point tensors, naming the last checkpoint under ``root``."""
    shown = ", ".join(bad[:4]) + (", ..." if len(bad) > 4 else "")
    return NonFiniteState(
        f"step {step}: {len(bad)} of {total} tensors of the parameters and optimizer state hold NaN or infinity "
        f"({shown}), so no checkpoint of step {step} is written; {last_checkpoint_note(root)}. Lower optim.lr, "
        "set optim.grad_clip, or try precision = \"fp32\".")


def _state_tensors(files: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """file -> name -> tensor as one ``"model.x.weight"``-named table (the file's stem, then the name)."""
    return {f"{Path(f).stem}.{k}": v for f, tensors in files.items() for k, v in tensors.items()}


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
                    planner_state: dict[str, torch.Tensor] | None = None) -> Path:
    """Atomically write checkpoint ``step`` under ``root``; keep the newest ``keep`` ones.

    Every tensor is whole (``gemzoo.distributed.state`` gathers sharded ones first). ``planner_state``: the
    planner's own state (``Planner.state_dict``), written to planner.safetensors when there is any."""
    root = Path(root)
    files = {"model.safetensors": {k: v.detach().contiguous().cpu() for k, v in model_state.items()}}
    optim_meta = {}
    for name, state in optimizers.items():
        tensors, meta = flatten_optimizer(state)
        files[f"optim-{name}.safetensors"] = tensors
        optim_meta[name] = meta
    if planner_state:
        files[PLANNER_FILE] = {k: v.detach().contiguous().cpu() for k, v in planner_state.items()}
    state = _state_tensors(files)
    bad = nonfinite_tensors(state)
    if bad:
        raise nonfinite_state(step, bad, count_floating(state), root)
    files["rng.safetensors"] = rng_state()
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        _write(tmp, final, root, files, {"format": FORMAT_VERSION, "step": step, "optimizers": optim_meta, **manifest})
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        full = " (the disk is full: free space first)" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        raise CheckpointError(
            f"writing checkpoint step {step} into {root} failed: {exc.strerror or exc}{full}. The write is atomic: "
            f"nothing of step {step} was committed and {_kept(root)}.") from None
    for old in list_checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _kept(root: Path) -> str:
    found = list_checkpoints(root)
    return f"the last good checkpoint, {found[-1]}, is kept (resume from it with --resume)" if found else \
        "no earlier checkpoint exists"


def _write(tmp: Path, final: Path, root: Path, files: dict[str, dict[str, torch.Tensor]], manifest: dict) -> None:
    """Write ``files`` and the manifest into ``tmp``, fsync them, and rename ``tmp`` to ``final``."""
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    entries = {}
    for fname, tensors in files.items():
        path = tmp / fname
        save_file(_dedupe_storage(tensors), str(path))
        entries[fname] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    pause = float(os.environ.get(PAUSE_ENV) or 0)
    if pause > 0:
        time.sleep(pause)
    full = json.loads(json.dumps({"format": manifest["format"], "step": manifest["step"], "files": entries,
                                  **manifest}, default=str))
    full[MANIFEST_HASH] = manifest_digest(full)
    with open(tmp / "manifest.json", "w") as f:
        json.dump(full, f, indent=1)
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


def _not_safetensors(path: Path, size: int) -> str | None:
    """Why ``path`` is not a safetensors file (an 8-byte header length, then that many bytes of a JSON object),
    or None. Checked before the parser sees it, so a pickle or a zip says so instead of "header too large"."""
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) < 9:
        return f"{size} bytes, shorter than a safetensors header"
    (n,) = struct.unpack("<Q", head[:8])
    if n > size - 8:
        return f"its first 8 bytes give a header of {n} bytes, longer than the file"
    if head[8:9] != b"{":
        return f"its header does not start a JSON object (it starts {head[8:9]!r})"
    return None


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
    if MANIFEST_HASH in manifest and manifest[MANIFEST_HASH] != manifest_digest(manifest):
        raise CheckpointError(f"{manifest_path} fails its own SHA-256 check (it was edited or corrupted after it "
                              "was written); resume from an earlier checkpoint (--resume picks the newest valid one)")
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
        problem = _not_safetensors(fpath, size)
        if problem:
            raise CheckpointError(f"{fpath} is not a safetensors file ({problem}); gemzoo reads checkpoints only as "
                                  "safetensors. Resume from an earlier checkpoint.")
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
            "planner": loaded.get(PLANNER_FILE, loaded.get(LEGACY_PLANNER_FILE, {})),
            "rng": loaded["rng.safetensors"], "path": path}


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
