"""scripts/install.sh skips an unchanged C++ build; benchmark scripts never eval their own output; the GPU
scripts in bench/ document their arguments, move the Triton cache and record each test's outcome."""

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gemzoo.testing.timeouts import hang_guard

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
                          capture_output=True, text=True, timeout=hang_guard(600))
    assert done.returncode == 0, done.stderr
    return [line for line in log.read_text().splitlines() if "-e ." in line]


@pytest.mark.multiprocess
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


def test_install_prints_one_progress_line_per_phase(tmp_path):
    root, log = _tree(tmp_path), tmp_path / "calls.log"
    log.write_text("")
    env = {k: v for k, v in os.environ.items() if k not in _stamp_module().BUILD_ENV}
    done = subprocess.run(["bash", "scripts/install.sh"], cwd=root, env={**env, "INSTALL_LOG": str(log)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    phases = [line for line in done.stdout.splitlines() if line.startswith("[install ")]
    assert [p.split(",")[0] for p in phases] == [f"[install {i}/4" for i in range(1, 5)], done.stdout
    assert "building the C++ extension" in phases[2]
    assert done.stdout.rstrip().splitlines()[-1].startswith("installed in")


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


@pytest.mark.multiprocess
def test_triton_cache_round_trips_the_cache_in_parts(tmp_path):
    """bench/triton_cache.py: Triton's cache packed into parts of at most --part-mib and unpacked elsewhere, file
    for file (how compiled kernels travel to the next machine of the same GPU and software)."""
    src, dst, out = tmp_path / "src", tmp_path / "dst", tmp_path / "out"
    (src / "abc").mkdir(parents=True)
    blob = os.urandom(3 << 20)  # incompressible: 3 MiB gives 3+ parts of 1 MiB
    (src / "abc" / "k.cubin").write_bytes(blob)
    (src / "abc" / "k.ttir").write_text("intermediate IR, left out")
    (src / "abc" / "__grp__k.json").write_text('{"child_paths": {}}')
    script = str(ROOT / "bench" / "triton_cache.py")

    def run(cache, *args):
        return subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=hang_guard(600),
                              env=dict(os.environ, TRITON_CACHE_DIR=str(cache)), check=True).stdout

    out.mkdir()
    (out / "triton.tgz.07").write_bytes(b"a stale part of an older pack")
    assert "triton:" in run(src, "pack", str(out), "--part-mib", "1")
    parts = sorted(p.name for p in out.iterdir())
    assert parts[:2] == ["triton.tgz.00", "triton.tgz.01"] and len(parts) >= 3 and "triton.tgz.07" not in parts
    assert all(p.stat().st_size <= 1 << 20 for p in out.iterdir())
    run(dst, "unpack", str(out))
    assert (dst / "abc" / "k.cubin").read_bytes() == blob
    assert (dst / "abc" / "__grp__k.json").read_text() == '{"child_paths": {}}'
    assert not (dst / "abc" / "k.ttir").exists()
    whole = tmp_path / "whole"
    run(src, "pack", str(whole))  # no --part-mib: one part
    assert [p.name for p in whole.iterdir()] == ["triton.tgz.00"]


GPU_SCRIPTS = ["bench/gpu_setup.sh", "bench/gpu_suite.sh", "bench/run_benches.sh"]


@pytest.mark.parametrize("script", GPU_SCRIPTS)
def test_gpu_scripts_parse_document_their_arguments_and_refuse_unknown_ones(script):
    assert subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True).returncode == 0
    helped = subprocess.run(["bash", str(ROOT / script), "--help"], capture_output=True, text=True, timeout=hang_guard(300))
    assert helped.returncode == 0 and helped.stdout.startswith(f"usage: bash {script}")
    bad = subprocess.run(["bash", str(ROOT / script), "--no-such-option"], capture_output=True, text=True,
                         timeout=hang_guard(300))
    assert bad.returncode == 2 and "--no-such-option" in bad.stderr and "--help" in bad.stderr


def test_run_benches_lists_its_steps_and_names_an_unknown_one(tmp_path):
    script = str(ROOT / "bench" / "run_benches.sh")
    steps = subprocess.run(["bash", script, "--list"], capture_output=True, text=True, timeout=hang_guard(300)).stdout.split()
    assert {"jfa", "gdpa", "block-attention", "mxfp8", "auto-ac", "act-quant", "batch-shuffle", "ncclx",
            "sharding-2d", "e2e"} <= set(steps)
    help_text = subprocess.run(["bash", script, "--help"], capture_output=True, text=True, timeout=hang_guard(300)).stdout
    assert all(f"\n  {name} " in help_text for name in steps), "every step is described in --help"
    for args in (["--only", "jfa"], ["--out", str(tmp_path), "--only", "jfa,nope"]):
        proc = subprocess.run(["bash", script, *args], capture_output=True, text=True, timeout=hang_guard(300))
        assert proc.returncode == 2, proc.stderr
    assert "--out DIR is required" in subprocess.run(["bash", script], capture_output=True, text=True,
                                                     timeout=hang_guard(300)).stderr
    assert "unknown step 'nope'" in proc.stderr and not (tmp_path / "steps.txt").exists()


@pytest.mark.multiprocess
def test_gpu_suite_writes_each_outcome_and_a_summary(tmp_path):
    """bench/gpu_suite.sh runs any pytest arguments and leaves per-test outcomes, failures and counts in --out."""
    tests = tmp_path / "test_tiny.py"
    tests.write_text("import pytest\n\n\ndef test_ok():\n    pass\n\n\ndef test_bad():\n    assert 1 == 2\n\n\n"
                     "@pytest.mark.skip(reason='shown as skipped')\ndef test_skipped():\n    pass\n")
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_suite.sh"), "--out", str(out), "--python",
                           sys.executable, "--", str(tests), "-p", "no:cacheprovider"],
                          capture_output=True, text=True, timeout=hang_guard(1500), cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # pytest's status: one test failed
    progress = (out / "progress.txt").read_text()
    assert " passed " in progress and " failed " in progress and " skipped " in progress
    assert "test_bad" in (out / "failures.txt").read_text()
    assert (out / "summary.txt").read_text().startswith("1 passed, 1 failed, 1 skipped")


def _multigpu():
    spec = importlib.util.spec_from_file_location("gemzoo_multigpu_bench", ROOT / "bench" / "multigpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_multigpu_plans_every_row_for_the_gpus_it_has():
    mg = _multigpu()
    runs = mg.plan_runs(mg.ROWS, [1, 2, 4, 8], 64, "jfa,bf16")
    by_row = {row: [r for r in runs if r.row == row] for row in mg.ROWS}
    assert [r.gpus for r in by_row["scaling"]] == [1, 2, 4, 8]
    assert [r.sets for r in by_row["scaling"]][-1] == ["data.batch_size=512"]  # weak scaling: 64 a GPU
    assert [r.name for r in by_row["sharding"]] == ["torchrec 1D"] + [f"sharding-2d G={g} {s}" for g in (2, 4)
                                                                      for s in ("replicated", "fully_sharded")]
    assert {r.name: r.sets[-1] for r in by_row["dense"]} == {
        "FSDP2": "run.mesh={shard=8}", "HSDP": "run.mesh={replicate=2,shard=4}", "TP=2": "run.mesh={tp=2,shard=4}"}
    assert by_row["comms"][1].plugins == "jfa,bf16,ncclx" and by_row["shuffle"][1].plugins.endswith("batch-shuffle")
    assert [r.row for r in mg.plan_runs(mg.ROWS, [1], 64, "jfa,bf16")] == ["scaling"]  # one GPU: the rest skip


@pytest.mark.slow
@pytest.mark.multiprocess
def test_multigpu_dry_run_on_gloo_compares_dense_layouts(tmp_path):
    """bench/multigpu.py end to end on CPU: torchrun of gemzoo train on 2 gloo processes, three dense layouts on
    one global batch; their losses agree (HSDP with one shard is FSDP2's arithmetic), the table is written."""
    import json

    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "multigpu.py"), "--dry-run", "--rows", "dense",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=hang_guard(1800), cwd=ROOT)
    record = json.loads((tmp_path / "multigpu.json").read_text())
    errors = {r["name"]: r["result"].get("error", "")[-1500:] for r in record["runs"] if "error" in r["result"]}
    assert proc.returncode == 0 and not errors, f"{proc.stderr[-1000:]}\n{errors}"
    dense = record["analysis"]["dense"]
    assert set(dense) == {"FSDP2", "HSDP", "TP=2"}
    assert all(r["world_size"] == 2 and len(r["losses"]) == 4 for r in dense.values())
    assert dense["HSDP"]["max_rel_loss_diff_vs_first"] < 1e-6
    assert dense["TP=2"]["max_rel_loss_diff_vs_first"] < 2e-2  # bf16 matmuls split across ranks round differently
    assert "| TP=2 | 2 |" in (tmp_path / "multigpu.md").read_text()
