"""Move Triton's (and optionally Inductor's) compile cache from one machine to another.

A fresh GPU machine compiles every Triton kernel variant again, which is most of the GPU tests' time. The
caches are keyed by kernel source, options, GPU and toolchain, so a machine with the same GPU and software
hits a cache packed elsewhere. ``pack`` writes each cache as a gzipped tar, split into parts of at most
``--part-mib`` MiB when a transport limits file sizes; ``unpack`` puts the parts back where this machine's
Triton and Inductor look::

    python3 bench/triton_cache.py pack ~/gemzoo-cache      # after a run: triton.tgz.00, ... in that folder
    python3 bench/triton_cache.py unpack ~/gemzoo-cache    # before the next one, on another machine

Triton's folder is ``TRITON_CACHE_DIR`` (or Triton's default); Inductor's is torch's cache folder.
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
# that are missing (FileCacheManager.get_group), so the intermediate IRs are left out: most of the cache's bytes.
IR_SUFFIXES = (".source", ".ttir", ".ttgir", ".llir", ".ptx", ".amdgcn")


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


def pack(out: Path, part_mib: int = 0, total_mib: int = 0, names=("triton",)) -> list[Path]:
    """Each cache of ``names`` as its own gzipped tar in ``out``, in parts of at most ``part_mib`` MiB (0: one
    part), while the total stays within ``total_mib`` MiB (0: no limit). Older parts of the same caches in
    ``out`` are replaced."""
    out.mkdir(parents=True, exist_ok=True)
    parts, used = [], 0
    for name, folder in cache_dirs().items():
        if name not in names:
            continue
        if not folder.is_dir():
            print(f"{name}: no cache at {folder}: nothing packed", flush=True)
            continue
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
            tar.add(folder, arcname=".", filter=_lean if name == "triton" else None)
        data = buf.getvalue()
        if total_mib and used + len(data) > total_mib << 20:
            print(f"{name}: {len(data) / 2**20:.1f} MiB compressed, over --total-mib {total_mib}: left out", flush=True)
            continue
        for old in out.glob(f"{name}{SUFFIX}*"):
            old.unlink()
        used += len(data)
        step = part_mib << 20 if part_mib else max(len(data), 1)
        for i in range(0, max(len(data), 1), step):
            parts.append(out / f"{name}{SUFFIX}{i // step:02d}")
            parts[-1].write_bytes(data[i:i + step])
        print(f"{name}: {folder} -> {len(data) / 2**20:.1f} MiB in {-(-len(data) // step)} part(s) in {out}",
              flush=True)
    return parts


def unpack(folder: Path) -> int:
    """Put each cache's parts found in ``folder`` back in this machine's cache folder."""
    if not folder.is_dir():
        print(f"{folder} is not a folder: nothing restored (pass the folder that `pack` wrote)", file=sys.stderr)
        return 1
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
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="pack DIR after a run, unpack DIR before the next one")
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack", help="write this machine's cache(s) into DIR")
    a.add_argument("dir", type=Path)
    a.add_argument("--part-mib", type=int, default=0, help="split each tar into parts of at most this many MiB "
                   "(default 0: one part)")
    a.add_argument("--total-mib", type=int, default=0, help="leave out a cache that would take the total over "
                   "this many MiB (default 0: no limit)")
    a.add_argument("--inductor", action="store_true",
                   help="Inductor's cache too (C++ and Triton code of compiled graphs; often hundreds of MiB)")
    b = sub.add_parser("unpack", help="restore the cache(s) packed in DIR")
    b.add_argument("dir", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "pack":
        if args.part_mib < 0 or args.total_mib < 0:
            p.error("--part-mib and --total-mib take a number of MiB >= 0 (0: no limit)")
        pack(args.dir, args.part_mib, args.total_mib, ("triton", "inductor") if args.inductor else ("triton",))
        return 0
    return unpack(args.dir)


if __name__ == "__main__":
    sys.exit(main())
