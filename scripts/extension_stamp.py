"""Print a hash of what the gemzoo._C build depends on; scripts/install.sh skips the build when it matches.

    python scripts/extension_stamp.py [--root DIR]

The hash covers every file under csrc/ (path and bytes), setup.py, the Python version (the .so is
built for one ABI), the installed torch version, and the environment variables setup.py reads.
It reads torch's version from the installed metadata, so it runs in a fraction of a second.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from importlib import metadata
from pathlib import Path

BUILD_ENV = ("GEMZOO_NO_EXTENSION", "GEMZOO_NO_CUDA", "GEMZOO_FORCE_CUDA", "TORCH_CUDA_ARCH_LIST", "CUDA_HOME")


def torch_version() -> str:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "none"


def digest(root: str | Path, *, torch: str | None = None, environ: dict | None = None) -> str:
    root = Path(root)
    environ = os.environ if environ is None else environ
    h = hashlib.sha256()
    sources = sorted(p for p in (root / "csrc").rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    for path in [*sources, root / "setup.py"]:
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    h.update(f"python {sys.version}\0torch {torch or torch_version()}\0".encode())
    for key in BUILD_ENV:
        h.update(f"{key}={environ.get(key, '')}\0".encode())
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", default=Path(__file__).resolve().parents[1], help="the gemzoo source tree")
    print(digest(p.parse_args().root))


if __name__ == "__main__":
    main()
