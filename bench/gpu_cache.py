"""Carry the Triton and Inductor compile caches from one device session to the next.

A fresh GPU machine compiles every Triton kernel variant of the test suite again (most of the GPU tests'
time); the caches are keyed by source, options, GPU and toolchain, so the next machine of the same image
hits them. The device tool returns at most 8 files of 16 MiB from $OUT and carries 64 MiB, so a cache
travels as gzipped tar parts of at most ``--part-mib`` each, Triton's (and with ``--inductor`` Inductor's)
while ``--total-mib`` allows:

    python3 bench/gpu_cache.py pack $OUT            # after the run: triton.tgz.00, ..., inductor.tgz.00 in $OUT
    python3 bench/gpu_cache.py unpack .bench/gpu-cache   # before it: the parts put back where they belong

On this machine: copy the returned parts to ``.bench/gpu-cache/`` (git-ignored) and carry that folder.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tarfile
from pathlib import Path

SUFFIX = ".tgz."  # triton.tgz.00, triton.tgz.01, inductor.tgz.00, ...
# Triton loads a cached kernel from its group's metadata .json and binary (.cubin) alone and skips group members
# that are missing (FileCacheManager.get_group), so the intermediate IRs stay home: most of the cache's bytes.
IR_SUFFIXES = (".source", ".ttir", ".ttgir", ".llir", ".ptx", ".amdgcn")
ORDER = ("triton", "inductor")


def _lean(info: tarfile.TarInfo):
    return None if info.name.endswith(IR_SUFFIXES) else info


def cache_dirs() -> dict[str, Path]:
    """name -> this machine's cache folder (made or not)."""
    try:
        from triton import knobs

        triton_dir = Path(knobs.cache.dir)
    except (ImportError, AttributeError):
        triton_dir = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return {"triton": triton_dir, "inductor": Path(cache_dir())}


def pack(out: Path, part_mib: int, total_mib: int, names=("triton",)) -> list[Path]:
    """Each cache of ``names`` as its own gzipped tar, in order, while the total stays within ``total_mib``."""
    out.mkdir(parents=True, exist_ok=True)
    parts, used, step = [], 0, part_mib << 20
    for name, folder in cache_dirs().items():
        if name not in names or not folder.is_dir():
            continue
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
            tar.add(folder, arcname=".", filter=_lean if name == "triton" else None)
        data = buf.getvalue()
        if used + len(data) > total_mib << 20:
            print(f"{name}: {len(data) / 2**20:.1f} MiB compressed, over --total-mib {total_mib}: left out", flush=True)
            continue
        used += len(data)
        for i in range(0, len(data), step):
            parts.append(out / f"{name}{SUFFIX}{i // step:02d}")
            parts[-1].write_bytes(data[i:i + step])
        print(f"{name}: {folder} -> {len(data) / 2**20:.1f} MiB in {-(-len(data) // step)} part(s)", flush=True)
    return parts


def unpack(folder: Path) -> int:
    """Put each cache's parts found in ``folder`` back in this machine's cache folder."""
    found = 0
    for name, target in cache_dirs().items():
        parts = sorted(folder.glob(f"{name}{SUFFIX}*"))
        if not parts:
            continue
        target.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts)), mode="r:gz") as tar:
            tar.extractall(target, filter="data")
            print(f"{name}: {len(tar.getmembers())} entries -> {target}", flush=True)
        found += 1
    if not found:
        print(f"no *{SUFFIX}* parts in {folder}: nothing restored", flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack")
    a.add_argument("out", type=Path)
    a.add_argument("--part-mib", type=int, default=15)
    a.add_argument("--total-mib", type=int, default=45)
    a.add_argument("--inductor", action="store_true",
                   help="Inductor's cache too (C++ and Triton code of compiled graphs; often hundreds of MiB)")
    b = sub.add_parser("unpack")
    b.add_argument("folder", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "pack":
        pack(args.out, args.part_mib, args.total_mib, ("triton", "inductor") if args.inductor else ("triton",))
        return 0
    return unpack(args.folder)


if __name__ == "__main__":
    sys.exit(main())
