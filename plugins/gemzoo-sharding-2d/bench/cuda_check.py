"""sharding-2d on CUDA: one process on one GPU, or 2-8 GPUs under torchrun over NCCL.

One process (``python bench/cuda_check.py``): gem-tiny narrowed (4 tables of 4096 x 16, 32 samples a step) for
5 steps with the built-in planner (no torchrec on the GPU image: whole tables, the trainer's Adagrad) and with
sharding-2d (G = 1: the engine's own Adagrad on CUDA); the losses must agree within 1e-5 relative.

Several GPUs (``torchrun --nproc-per-node 4 bench/cuda_check.py --multi``): sharding-2d with G = W / 2 x R = 2,
replicated and fully sharded, against the one-process losses in ``OUT_DIR/cuda_single.json`` (run the one-process
mode first, into the same ``OUT_DIR``); rank 0 writes the losses, table bytes a rank and collective bytes a step.
Both finish well under 120 s on an H200. Results: ``OUT_DIR/cuda_single.json`` / ``OUT_DIR/cuda_multi.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "gem-tiny.toml"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # sharding_2d_measure


def overrides(out: str, planner: str, options: dict | None = None) -> list[str]:
    sets = ["run.steps=5", "run.device='cuda'", "eval.every=0", "checkpoint.every=0", f"run.out_dir='{out}'",
            f"plugins.planner='{planner}'", "data.batch_size=32", "data.max_len=24", "data.median_len=8",
            "data.max_candidates=4", "data.sparse_table_size=4096", "model.d_model=16", "model.num_layers=1",
            "model.embedding_dim=16", "model.mlp_dims=[16, 8]", "run.dense_parallel='ddp'", "run.log_every=1"]
    return sets + [f"plugins.options.sharding-2d.{k}={json.dumps(v)}" for k, v in (options or {}).items()]


def main() -> None:
    import torch
    from sharding_2d_measure import train_and_record

    from gemzoo.api import load_config

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".", help="folder for the JSON result")
    ap.add_argument("--multi", action="store_true", help="under torchrun: G = W/2 x R = 2 over NCCL")
    args = ap.parse_args()
    out = Path(args.out)
    tmp = tempfile.mkdtemp(prefix="s2d-cuda-")
    assert torch.cuda.is_available(), "needs a GPU"
    if not args.multi:
        base = train_and_record(load_config(str(CONFIG), overrides=overrides(f"{tmp}/base", "torchrec")))
        ours = train_and_record(load_config(str(CONFIG), overrides=overrides(f"{tmp}/s2d", "sharding-2d")))
        rel = max(abs(a - b) / abs(b) for a, b in zip(ours["losses"], base["losses"], strict=False))
        result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "builtin": base["losses"],
                  "sharding-2d": ours["losses"], "max_rel_diff": rel, "ok": rel <= 1e-5}
        (out / "cuda_single.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(result))
        return
    world = int(os.environ["WORLD_SIZE"])
    single = json.loads((out / "cuda_single.json").read_text())["builtin"]
    result = {"world": world, "single": single}
    for strategy in ("replicated", "fully_sharded"):
        r = train_and_record(load_config(str(CONFIG), overrides=overrides(
            f"{tmp}/{strategy}", "sharding-2d", {"group_size": world // 2, "strategy": strategy})))
        r["max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], single, strict=False))
        r["bytes"] = r["bytes"][-1] if r["bytes"] else None
        result[strategy] = r
    if int(os.environ.get("RANK", "0")) == 0:
        (out / "cuda_multi.json").write_text(json.dumps(result, indent=1))
        print(json.dumps({k: (v["max_rel_diff"] if isinstance(v, dict) else v) for k, v in result.items()}))


if __name__ == "__main__":
    main()
