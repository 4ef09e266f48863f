"""ncclx: registration and capabilities, the schedule, bad options; on 2 and 4 gloo ranks every claimed
collective equals gloo's bit for bit (every dtype, zero/odd/even/uneven sizes, in place), bad calls raise the
same error on every rank, the comms conformance suite, and gem-tiny's 2-rank losses equal the default
backend's; the benchmark's CPU dry run (its 2-rank check runs inside the 2-rank test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import ncclx_cases as cases
import pytest
import torch
from gemzoo_ncclx import IMPLEMENTS, NcclxComms, NcclxOptions
from gemzoo_ncclx import cuda as C
from gemzoo_ncclx import schedule as S
from gemzoo_ncclx.cuda import no_p2p_message

from gemzoo.api import COLLECTIVES, ConfigError, registry
from gemzoo.testing.comms import BASE_COLLECTIVES, spawn
from gemzoo.testing.timeouts import hang_guard

HERE = Path(__file__).resolve().parents[1]


def test_entry_point_registers_an_sm_free_backend():
    entry = registry.entry("comms", "ncclx")
    assert isinstance(entry.obj, NcclxComms) and entry.distribution == "gemzoo-ncclx"
    caps = entry.obj.capabilities
    assert caps.sm_free and caps.implements == IMPLEMENTS <= COLLECTIVES
    assert {"all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"} <= caps.implements
    assert {"all_reduce", "broadcast", "barrier"} <= caps.delegated
    assert entry.obj.backend_for("cpu") == entry.obj.backend_for("cuda") == "ncclx"


def test_gemzoo_plugins_shows_sm_free_and_what_it_runs(capsys, monkeypatch):
    from gemzoo.testing import cli_main as main

    assert main(["plugins", "--json"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out) if r["distribution"] == "gemzoo-ncclx"]
    assert rows[0]["comms"] == {"ncclx": {"sm_free": True, "implements": sorted(IMPLEMENTS)}}
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["plugins", "--verbose"]) == 0  # plain `plugins` reads metadata only
    out = " ".join(capsys.readouterr().out.split())
    assert "ncclx: sm_free = yes; runs itself: all_gather, all_gather_into_tensor, all_to_all" in out


def test_options_are_checked():
    comms = NcclxComms().configure(NcclxOptions(chunk_bytes=1 << 20, reduce_blocks=4))
    assert comms.options.reduce_blocks == 4
    with pytest.raises(ConfigError, match=r"plugins.options.ncclx.chunk_bytes must be an integer >= 16, got 8"):
        NcclxOptions(chunk_bytes=8)
    with pytest.raises(ConfigError, match=r"reduce_blocks must be an integer >= 1, got 0"):
        NcclxOptions(reduce_blocks=0)
    with pytest.raises(ConfigError, match="must be NcclxOptions"):
        NcclxComms().configure({"chunk_bytes": 1})


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_pull_schedule_is_a_permutation_per_step(world):
    for step in range(1, world):
        pulled = [S.pull_from(r, step, world) for r in range(world)]
        assert sorted(pulled) == list(range(world)) and all(p != r for r, p in enumerate(pulled))
        assert all(S.serve_to(p, step, world) == r for r, p in enumerate(pulled))
    for r in range(world):
        order = S.ring_order(r, world)
        assert sorted(order) == list(range(world)) and order[-1] == r


def test_pieces_and_reduction_order():
    assert S.pieces(0, 4) == [] and S.pieces(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert S.chunk_elems(64, torch.bfloat16) == 32 and S.chunk_elems(4, torch.float64) == 1
    big, one = torch.tensor([1e8], dtype=torch.float32), torch.tensor([1.0])
    out = torch.empty(1)
    S.reduce_parts(out, [big, one, -big, one], S.REDUCE_CODES["SUM"], 4)  # rounds after every step, in order
    assert out.item() == 1.0
    S.reduce_parts(out, [one, one, big, -big], S.REDUCE_CODES["AVG"], 4)
    assert out.item() == 0.0


def test_rows_that_disagree_raise_naming_ranks_and_sizes():
    W = 2
    rows = lambda *rs: S.parse(torch.cat(list(rs)), W)  # noqa: E731
    ok = S.meta_row(W, S.ALL_GATHER, torch.float32, S.NO_REDUCE, 0, [3, 3], [3, 3])
    S.check_rows(rows(ok, ok), W, "all_gather_into_tensor")
    with pytest.raises(S.NcclxError, match=r"rank 0: 3 elements, rank 1: 4 elements"):
        S.check_rows(rows(ok, S.meta_row(W, S.ALL_GATHER, torch.float32, S.NO_REDUCE, 0, [4, 4], [4, 4])), W, "x")
    with pytest.raises(S.NcclxError, match=r"rank 1 passed a non-contiguous tensor"):
        S.check_rows(rows(ok, S.meta_row(W, S.ALL_GATHER, torch.float32, S.NO_REDUCE, 1, None, None)), W, "x")
    a2a = lambda s, r: S.meta_row(W, S.ALL_TO_ALL, torch.int64, S.NO_REDUCE, 0, s, r)  # noqa: E731
    with pytest.raises(S.NcclxError, match=r"rank 0 sends 2 elements to rank 1 but rank 1 expects 1 from rank 0"):
        S.check_rows(rows(a2a([1, 2], [1, 0]), a2a([0, 5], [1, 5])), W, "all_to_all_single")


def test_a_pair_without_peer_access_is_named():
    infos = [{"host": "a", "device": d} for d in range(3)]
    assert no_p2p_message(infos, [[True] * 3] * 3, "group '0' of 3 ranks") is None
    matrix = [[True, True, True], [True, True, False], [True, True, True]]  # 1 cannot map 2's memory
    msg = no_p2p_message(infos, matrix, "group '0' of 3 ranks")
    assert "ranks 1 (cuda:1 on a) and 2 (cuda:2 on a)" in msg and "uses NCCL" in msg and "0 (cuda:0" not in msg


def _semantics(tmp_path, world, conformance=False):
    # the CPU transport (gloo point-to-point): on a GPU machine the ranks start with CUDA hidden, as on CI (with
    # CUDA visible, 2-4 ranks would share one GPU's NCCL group and say nothing of gloo)
    spawn(cases.semantics_rank, world, str(tmp_path), conformance, hide_cuda=True)
    out = [json.loads((tmp_path / f"sem{r}.json").read_text()) for r in range(world)]
    for r, o in enumerate(out):
        assert o["checked"] == out[0]["checked"] >= 190
        # ncclx ran every claimed collective itself (none went to gloo)
        assert set(o["own"]) == IMPLEMENTS and not o["delegated"], o
        assert len(o["said"]) == 1 and "gloo point-to-point" in o["said"][0]
        for label, err in o["errors"].items():  # every bad call raised on every rank
            assert err is not None, f"rank {r}: {label} did not raise"
    e = out[0]["errors"]
    assert "input sizes differ across ranks (rank 0: 3 elements, rank 1: 4 elements" in e["all_gather sizes"]
    assert "rank 0 passed output sizes that do not fit" in e["all_gather output"]
    assert "sends 3 elements to rank 1 but rank 1 expects 4 from rank 0" in e["all_to_all splits"]
    assert "rank 0 all_gather (torch.float32), rank 1 reduce_scatter (torch.float32, SUM)" in e["different collectives"]
    assert "output sizes differ" in e["reduce_scatter sizes"] and "torch.float64" in e["dtypes"]
    return out


class _PullExt:
    """copy_async / copy_batch_async that record their calls; the batch call can be built in and can fail."""

    def __init__(self, has_batch: bool, batch_fails: bool):
        self.HAS_COPY_BATCH, self.fails, self.calls = has_batch, batch_fails, []

    def copy_batch_async(self, *args):
        if self.fails:
            raise RuntimeError("ncclx: cudaMemcpyBatchAsync (PreferOverlapWithCompute) failed: driver too old")
        self.calls.append(("batch", *args))

    def copy_async(self, *args):
        self.calls.append(("memcpy", *args))


def test_peer_pulls_use_the_batch_copy_when_asked_and_fall_back(monkeypatch):
    monkeypatch.delenv("GEMZOO_NCCLX_PULL", raising=False)
    assert C.pull_path(_PullExt(True, False)) == C.MEMCPY  # the default: the path checked on the H200
    monkeypatch.setenv("GEMZOO_NCCLX_PULL", "batch")
    assert C.pull_path(_PullExt(True, False)) == C.BATCH and C.pull_path(_PullExt(False, False)) == C.MEMCPY
    assert C.pull_path(object()) == C.MEMCPY  # a C++ part built before copy_batch_async existed
    monkeypatch.setenv("GEMZOO_NCCLX_PULL", "fast")
    with pytest.raises(ValueError, match="GEMZOO_NCCLX_PULL='fast'"):
        C.pull_path(_PullExt(True, False))
    monkeypatch.setenv("GEMZOO_NCCLX_PULL", "batch")
    for fails, want in ((False, ["batch", "batch"]), (True, ["memcpy", "memcpy"])):
        t = C.CudaTransport.__new__(C.CudaTransport)  # only the pull path: no device, no group
        t.ext = _PullExt(True, fails)
        t.pull_path, t.pull_fallback = C.pull_path(t.ext), None
        t._pull(8, 16, 32, 7)
        t._pull(8, 16, 32, 7)
        assert [c[0] for c in t.ext.calls] == want and all(c[1:] == (8, 16, 32, 7) for c in t.ext.calls)
        assert t.pull_path == (C.MEMCPY if fails else C.BATCH)
        assert (t.pull_fallback is not None and "driver too old" in t.pull_fallback) == fails


@pytest.mark.multiprocess
def test_two_ranks_bit_identical_to_gloo_and_conformance(tmp_path):
    _semantics(tmp_path, 2, conformance=True)
    summary = json.loads((tmp_path / "comms0.json").read_text())["ncclx"]
    assert summary["sm_free"] and set(summary["claimed"]) == IMPLEMENTS
    assert set(summary["checked"]) == set(BASE_COLLECTIVES) | IMPLEMENTS
    assert summary["meshes"] == {"2": {"dp": "ncclx"}, "2x1": {"replica": "ncclx", "shard": "ncclx"},
                                 "1x2": {"replica": "ncclx", "shard": "ncclx"}}
    for r in range(2):  # bench_overlap.py's 2-rank check, over the gloo transport here
        smoke = json.loads((tmp_path / f"smoke{r}.json").read_text())
        assert smoke["checked"] == 36 and smoke["mismatches"] == [] and smoke["transport"] == "GlooTransport"


@pytest.mark.multiprocess
def test_four_ranks_bit_identical_to_gloo(tmp_path):
    _semantics(tmp_path, 4)


@pytest.mark.multiprocess
def test_gem_tiny_two_ranks_losses_equal_the_default_backend(tmp_path):
    """3 steps of gem-tiny on 2 gloo ranks with comms = "torch", then "ncclx": the same losses bit for bit (FSDP2's
    all-gathers and reduce-scatters and torchrec's all-to-alls run through ncclx), and the start row logs ncclx's
    sm_free, claims and groups."""
    spawn(cases.train_rank, 2, str(tmp_path), [("torch", "torch", 3), ("ncclx", "ncclx", 3)], hide_cuda=True)
    ranks = [json.loads((tmp_path / f"train{r}.json").read_text()) for r in range(2)]
    torch_run, ncclx_run = ranks[0]["torch"], ranks[0]["ncclx"]
    assert len(ncclx_run["losses"]) == 3 and ncclx_run["losses"] == torch_run["losses"]
    assert ranks[1]["ncclx"]["losses"] == ncclx_run["losses"]
    from gemzoo.api import torchrec_available

    # FSDP2's gathers and reduce-scatters; torchrec's all-to-alls where the tables are torchrec's (without
    # torchrec, as on the GPU image, the plain-torch tables are replicated and need none)
    ran = {"all_gather_into_tensor", "reduce_scatter_tensor"} | ({"all_to_all_single"} if torchrec_available() else set())
    assert ran <= set(ncclx_run["own"]), ncclx_run["own"]
    assert ncclx_run["comms"] == {"name": "ncclx", "sm_free": True, "implements": sorted(IMPLEMENTS),
                                  "groups": {"dp": "ncclx"}}
    assert torch_run["comms"]["sm_free"] is False


@pytest.mark.multiprocess
def test_bench_dry_run_writes_its_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(HERE / "bench" / "bench_overlap.py"), "--dry-run", "--no-smoke",
                           "--out", str(out)], capture_output=True, text=True, timeout=hang_guard(600))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["dry_run"] and {r["mode"] for r in result["rows"]} >= {"alone-before", "copy-engine", "sm-copy",
                                                                         "alone-after"}
    assert "slowdown_pct" in result["rows"][1] and "GEMM" in proc.stdout
    modes = {r["mode"] for r in result["rows"]}
    assert {"h2d", "d2h", "copy-batch", "sm-matched-h2d", "sm-matched-d2h", "sm-matched-copy-batch"} <= modes
    assert all("slowdown_pct_per_100GBps" in r and "moves_on" in r for r in result["rows"])
    assert {c["copy_engine_mode"] for c in result["comparison"]} == {"h2d", "d2h", "copy-batch"}
    assert set(result["rate_matched"]["1"]) == {"h2d", "d2h", "copy-batch"} and "rate-matched" in proc.stdout


@pytest.mark.multiprocess
def test_cuda_transport_bookkeeping_on_a_fake_device(tmp_path):
    """CudaTransport (staging slots and generations, IPC handles through the store, peer offsets, pieces) with
    the C++ calls replaced by shared-memory stand-ins (ncclx_cases.FakeExt) on 3 ranks: every claimed
    collective still equals gloo's bit for bit and bad calls still raise everywhere; the peer check first
    refuses a group whose ranks 0 and 1 lack P2P, naming them, and builds the transport when every pair has it."""
    spawn(cases.semantics_rank, 3, str(tmp_path), False, True)
    for r in range(3):
        o = json.loads((tmp_path / f"sem{r}.json").read_text())
        assert o["checked"] >= 90 and set(o["own"]) == IMPLEMENTS and not o["delegated"]
        assert all(err is not None for err in o["errors"].values()), o["errors"]
        assert "rank 1 passed a collective too large for its staging buffer" in o["errors"]["staging"]
        cuda = o["cuda"]
        assert cuda["refused"] is False and cuda["transport"] == "CudaTransport" and cuda["copies"] > 500
        assert len(cuda["messages"]) == 1 and "no peer-to-peer access between ranks 0 (cuda:0" in cuda["messages"][0]
        assert "and 1 (cuda:1" in cuda["messages"][0] and "uses NCCL" in cuda["messages"][0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_two_processes_on_one_gpu_equal_the_gloo_transport(tmp_path):
    """The real CUDA path on one GPU: 2 processes share it (CUDA IPC staging, interprocess events, copy-engine
    pulls); every claimed collective equals the group's gloo transport bit for bit (bench_overlap's check)."""
    import argparse

    sys.path.insert(0, str(HERE / "bench"))
    from bench_overlap import smoke

    result = smoke(argparse.Namespace(dry_run=False, smoke_timeout=hang_guard(900), pull="memcpy"), tmp_path)  # training's path
    assert result["exit_codes"] == [0, 0], result
    for r in result["ranks"]:
        assert r["transport"] == "CudaTransport", r["said"]
        assert r["checked"] == 36 and r["mismatches"] == [], r
