"""scripts/install.sh skips an unchanged C++ build; benchmark scripts never eval their own output."""

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _stamp_module():
    spec = importlib.util.spec_from_file_location("gemzoo_extension_stamp", ROOT / "scripts" / "extension_stamp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tree(tmp_path) -> Path:
    """A source tree with what install.sh and the stamp read, and a .venv whose python logs each call."""
    root = tmp_path / "src"
    (root / "scripts").mkdir(parents=True)
    shutil.copytree(ROOT / "csrc", root / "csrc")
    for name in ("setup.py", "scripts/install.sh", "scripts/extension_stamp.py"):
        shutil.copy(ROOT / name, root / name)
    (root / "requirements").mkdir()
    (root / "requirements" / "cpu-lock.txt").write_text("")
    (root / "gemzoo").mkdir()
    fake = root / ".venv" / "bin" / "python"
    fake.parent.mkdir(parents=True)
    fake.write_text(f"""#!/usr/bin/env bash
echo "NO_EXTENSION=${{GEMZOO_NO_EXTENSION:-}} $*" >> "$INSTALL_LOG"
if [ "$1" = scripts/extension_stamp.py ]; then exec {sys.executable} "$@"; fi
case "$*" in *"-e ."*) [ -n "${{GEMZOO_NO_EXTENSION:-}}" ] || touch gemzoo/_C.fake.so;; esac
""")
    fake.chmod(0o755)
    return root


def _install(root: Path, log: Path) -> list[str]:
    log.write_text("")
    env = {k: v for k, v in os.environ.items() if k not in _stamp_module().BUILD_ENV}
    done = subprocess.run(["bash", "scripts/install.sh"], cwd=root, env={**env, "INSTALL_LOG": str(log)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [line for line in log.read_text().splitlines() if "-e ." in line]


def test_install_builds_once_then_skips_until_sources_change(tmp_path):
    root, log = _tree(tmp_path), tmp_path / "calls.log"
    assert _install(root, log)[0].startswith("NO_EXTENSION= ")  # first run: builds, writes the stamp
    assert (root / ".venv" / ".gemzoo-extension-stamp").is_file()
    assert _install(root, log)[0].startswith("NO_EXTENSION=1 ")  # nothing changed: no C++ build
    source = next((root / "csrc").rglob("*.cpp"))
    source.write_text(source.read_text() + "\n// changed\n")
    assert _install(root, log)[0].startswith("NO_EXTENSION= ")  # a source changed: build again
    assert _install(root, log)[0].startswith("NO_EXTENSION=1 ")
    for so in (root / "gemzoo").glob("_C*.so"):
        so.unlink()
    assert _install(root, log)[0].startswith("NO_EXTENSION= ")  # the built library is gone: build again


def test_stamp_follows_sources_torch_and_build_variables(tmp_path):
    stamp = _stamp_module()
    root = _tree(tmp_path)
    base = stamp.digest(root, torch="2.13.0", environ={})
    assert stamp.digest(root, torch="2.13.0", environ={}) == base
    assert stamp.digest(root, torch="2.14.0", environ={}) != base
    assert stamp.digest(root, torch="2.13.0", environ={"GEMZOO_NO_CUDA": "1"}) != base
    os.utime(root / "setup.py")  # a touch alone changes nothing
    assert stamp.digest(root, torch="2.13.0", environ={}) == base
    (root / "setup.py").write_text((root / "setup.py").read_text() + "\n")
    assert stamp.digest(root, torch="2.13.0", environ={}) != base


BENCH_SCRIPTS = sorted([*ROOT.glob("bench/*.py"), *ROOT.glob("plugins/*/bench/*.py")])


@pytest.mark.parametrize("path", BENCH_SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_bench_scripts_do_not_eval_or_exec(path):
    calls = [node.lineno for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("eval", "exec")]
    assert not calls, f"{path.relative_to(ROOT)} calls eval/exec at lines {calls}"


def test_gpu_cache_round_trips_the_triton_cache_in_parts(tmp_path):
    """bench/gpu_cache.py: Triton's cache packed into parts of at most --part-mib and unpacked elsewhere, file
    for file (how the H200 suite's compiled kernels travel to the next session)."""
    src, dst, out = tmp_path / "src", tmp_path / "dst", tmp_path / "out"
    (src / "abc").mkdir(parents=True)
    blob = os.urandom(3 << 20)  # incompressible: 3 MiB gives 3+ parts of 1 MiB
    (src / "abc" / "k.cubin").write_bytes(blob)
    (src / "abc" / "__grp__k.json").write_text('{"child_paths": {}}')
    script = str(ROOT / "bench" / "gpu_cache.py")
    run = lambda cache, *args: subprocess.run(  # noqa: E731
        [sys.executable, script, *args], capture_output=True, text=True, timeout=120,
        env=dict(os.environ, TRITON_CACHE_DIR=str(cache)), check=True).stdout
    assert "triton:" in run(src, "pack", str(out), "--part-mib", "1")
    parts = sorted(p.name for p in out.iterdir())
    assert parts[:2] == ["triton.tgz.00", "triton.tgz.01"] and len(parts) >= 3
    assert all(p.stat().st_size <= 1 << 20 for p in out.iterdir())
    run(dst, "unpack", str(out))
    assert (dst / "abc" / "k.cubin").read_bytes() == blob
    assert (dst / "abc" / "__grp__k.json").read_text() == '{"child_paths": {}}'
