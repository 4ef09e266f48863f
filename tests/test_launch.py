"""``gemzoo launch [torchrun options] -- COMMAND``: the command lines it builds, the checks before any worker starts,
the one resume message, and (slow) a 2-rank gloo run of gem-tiny stopped by Ctrl-C."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gemzoo.cli import build_parser, main
from gemzoo.cli.main import _parse_launch
from gemzoo.distributed.launch import (
    LAUNCH_ENV,
    Interruption,
    children,
    launch_command,
    launch_prefix,
    torchrun_argv,
)
from gemzoo.testing.timeouts import hang_guard

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "gem-tiny.toml")


def test_options_before_the_separator_go_to_torchrun_in_their_order():
    args = _parse_launch(build_parser(), ["launch", "--standalone", "--nnodes", "1", "--nproc_per_node=4",
                                          "--max-restarts", "0", "--", "train", "--config", "c.toml", "--", "x"])
    assert args.nproc_per_node == "4" and args.torchrun == ["--standalone", "--nnodes", "1", "--max-restarts", "0"]
    assert args.command == ["train", "--config", "c.toml", "--", "x"]  # only the first -- separates
    assert args.func == "gemzoo.cli.launch:cmd_launch"
    plain = _parse_launch(build_parser(), ["launch", "--", "train", "--config", "c.toml"])
    assert plain.nproc_per_node == "1" and plain.torchrun == []


def test_a_missing_separator_is_named_with_an_example(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["launch", "--nproc-per-node", "2", "train", "--config", TINY])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "put the gemzoo command after --" in err and "gemzoo launch --nproc-per-node 2 -- train" in err
    with pytest.raises(SystemExit) as exc:
        main(["launch", "--help"])
    assert exc.value.code == 0 and "TORCHRUN OPTION" in capsys.readouterr().out


def test_torchrun_and_resume_command_lines():
    options = ["--nproc-per-node", "2", "--nnodes", "1"]
    assert torchrun_argv(options, ["train", "--config", "c.toml"]) == [
        "--nproc-per-node", "2", "--nnodes", "1", "-m", "gemzoo.cli", "train", "--config", "c.toml"]
    prefix = launch_prefix(options, argv0="/venv/bin/gemzoo")
    assert prefix == ["gemzoo", "launch", "--nproc-per-node", "2", "--nnodes", "1", "--"]
    assert launch_prefix([], argv0="/src/gemzoo/cli/__main__.py")[:4] == ["python", "-m", "gemzoo.cli", "launch"]
    worker = {"TORCHELASTIC_RUN_ID": "r", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
              LAUNCH_ENV: "gemzoo launch --nproc-per-node 2 --nnodes 1 --"}
    assert launch_command(["train", "--out", "a b", "--resume"], environ=worker) == [
        "gemzoo", "launch", "--nproc-per-node", "2", "--nnodes", "1", "--", "train", "--out", "a b", "--resume"]
    # a plain torchrun worker (no marker) still gets torchrun's line; one process, the program's
    del worker[LAUNCH_ENV]
    assert launch_command(["train"], environ=worker)[:1] == ["torchrun"]
    assert launch_command(["train"], environ={LAUNCH_ENV: "gemzoo launch --"}, argv0="gemzoo") == ["gemzoo", "train"]


@pytest.mark.parametrize("rank", ["0", "1"])
def test_only_rank_0_prints_one_message_with_the_launch_line(tmp_path, monkeypatch, capsys, rank):
    from gemzoo.cli import train as train_cmd
    from gemzoo.train.loop import TrainingInterrupted

    def interrupted(cfg, **kwargs):
        raise TrainingInterrupted(signal.SIGINT, 7, tmp_path / "checkpoints" / "step-00000007", tmp_path)

    monkeypatch.setattr(train_cmd, "train", interrupted)
    for key, value in {"TORCHELASTIC_RUN_ID": "r", "RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": "2",
                       "LOCAL_WORLD_SIZE": "2", LAUNCH_ENV: "gemzoo launch --nproc-per-node 2 --"}.items():
        monkeypatch.setenv(key, value)
    assert main(["train", "--config", TINY, "--out", str(tmp_path), "--overwrite"]) == 130
    err = capsys.readouterr().err
    if rank == "1":
        assert err == ""
        return
    assert err.count("gemzoo: SIGINT") == 1 and err.count("Resume with:") == 1
    assert f"gemzoo launch --nproc-per-node 2 -- train --config {TINY} --out {tmp_path} --resume" in err


def test_a_ctrl_c_before_training_is_one_line_from_rank_0(monkeypatch, capsys):
    from gemzoo.cli import info

    def stopped(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(info, "cmd_info", stopped)
    for rank, said in (("1", ""), ("0", "gemzoo: interrupted\n")):
        monkeypatch.setenv("RANK", rank)
        assert main(["info"]) == 130
        assert capsys.readouterr().err == said


@pytest.mark.parametrize(("argv", "message"), [
    (["launch", "--"], "no command after --"),
    (["launch", "--", "launch", "--", "train"], "not launch"),
    (["launch", "--", "trian", "--config", TINY], "'trian' is not a gemzoo command"),
    (["launch", "--no-such-torchrun-option", "--", "train", "--config", TINY], "torchrun does not take"),
    (["launch", "--", "train", "--config", TINY, "--set", "optim.betas=[0.9]"], "optim.betas must list 2"),
    (["launch", "--", "train", "--config", TINY, "--plugins", "nosuchkernel"], "no plugin named 'nosuchkernel'"),
])
def test_bad_launch_lines_are_refused_before_any_worker_starts(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_device_this_node_lacks_is_refused_once(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["launch", "--nproc-per-node", "2", "--", "train", "--config", TINY, "--set", "run.device=cuda"]) == 2
    assert "run.device asks for cuda but no GPU is visible" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert main(["launch", "--nproc-per-node", "4", "--", "train", "--config", TINY, "--set", "run.device=cuda"]) == 2
    assert "--nproc-per-node 4 workers but this node shows 2 GPU(s)" in capsys.readouterr().err


def test_the_command_after_the_separator_is_parsed_once_here(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["launch", "--", "train", "--steps", "3"])  # train needs --config
    assert exc.value.code == 2 and "--config" in capsys.readouterr().err


def test_a_second_ctrl_c_goes_to_the_workers_at_once(monkeypatch):
    """The first signal is torchrun's SignalException (the agent sends it on once, to every worker); a second
    SIGINT goes straight to each worker's process group (they stop without a checkpoint)."""
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException

    # the child restores Python's SIGINT handler itself: a test run started in the background inherits SIGINT
    # ignored, and Python then leaves it ignored
    worker = subprocess.Popen([sys.executable, "-c", "import signal, time\n"
                               "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
                               "try:\n    print('up', flush=True)\n    time.sleep(60)\n"
                               "except KeyboardInterrupt:\n    raise SystemExit(42)"],
                              start_new_session=True, stdout=subprocess.PIPE, text=True)
    try:
        assert worker.pid in children(os.getpid())
        handler = Interruption()
        for name in list(logging.Logger.manager.loggerDict):  # quiet_torchrun's change ends with the test
            if name.startswith("torch.distributed"):
                monkeypatch.setattr(logging.getLogger(name), "level", logging.getLogger(name).level)
        monkeypatch.setattr(logging.getLogger("torch.distributed.elastic.agent.server.api"), "level", logging.INFO)
        with pytest.raises(SignalException) as exc:
            handler(signal.SIGINT, None)
        assert exc.value.sigval == signal.SIGINT and handler.signum == signal.SIGINT
        assert logging.getLogger("torch.distributed.elastic.agent.server.api").level == logging.CRITICAL
        assert worker.stdout.readline() == "up\n"  # the child waits inside its try: a SIGINT is its KeyboardInterrupt
        handler(signal.SIGTERM, None)  # a SIGTERM after the first signal changes nothing
        assert worker.poll() is None
        handler(signal.SIGINT, None)
        assert worker.wait(timeout=hang_guard(30)) == 42
    finally:
        worker.kill()
        worker.wait()
        worker.stdout.close()


def test_a_failed_worker_is_one_line_with_its_rank_and_code(monkeypatch, capsys, tmp_path):
    """What torchrun's agent raises when a worker fails becomes one line (rank, code) and that exit code, not
    torchrun's traceback; the signal the agent saw becomes 128 + its number. The workers' environment names the
    launch line."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from gemzoo.distributed.launch import SHUTDOWN_ENV, run_torchrun

    seen = {}

    def failing(args):
        seen.update(env=os.environ[LAUNCH_ENV], timeout=os.environ[SHUTDOWN_ENV], nproc=args.nproc_per_node,
                    script=[args.training_script, *args.training_script_args])
        later = ProcessFailure(0, 11, -15, str(tmp_path / "none.json"))
        first = ProcessFailure(1, 12, 2, str(tmp_path / "none.json"))
        first.timestamp, later.timestamp = 1, 2
        raise ChildFailedError("gemzoo.cli", {0: later, 1: first})

    monkeypatch.setattr(torchrun, "run", failing)
    for name in (LAUNCH_ENV, SHUTDOWN_ENV):  # set, then removed: put back as they were when the test ends
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    assert run_torchrun(["--nproc-per-node", "2"], ["train", "--config", "c.toml"], argv0="gemzoo") == 2
    assert seen == {"env": "gemzoo launch --nproc-per-node 2 --", "timeout": "600", "nproc": "2",
                    "script": ["gemzoo.cli", "train", "--config", "c.toml"]}
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rank 1 failed first, exiting with code 2" in err

    def signalled(args):
        raise SignalException("got SIGTERM", sigval=signal.SIGTERM)

    monkeypatch.setattr(torchrun, "run", signalled)
    assert run_torchrun([], ["train", "--config", "c.toml"]) == 143 and capsys.readouterr().err == ""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ctrl_c_on_two_gloo_ranks_exits_130_with_one_message_and_no_traceback(tmp_path):
    """gemzoo launch over 2 gloo ranks of gem-tiny; SIGINT to its process group, as a terminal's Ctrl-C sends it."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "gemzoo.cli", "launch", "--nproc-per-node", "2", "--", "train", "--config", TINY,
           "--out", str(out), "--quiet", "--set", "run.device=cpu", "--set", "run.log_every=1",
           "--set", "eval.every=0"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True, cwd=ROOT)
    try:
        deadline = time.monotonic() + hang_guard(60)
        metrics = out / "metrics.jsonl"
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.is_file() and any('"loss"' in line for line in metrics.read_text().splitlines()):
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=hang_guard(60))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stdout + stderr and "SignalException" not in stderr, stderr
    assert "death signal" not in stderr and "closing signal" not in stderr, stderr  # torchrun's agent is quiet
    assert stdout == "", stdout
    assert stderr.count("Resume with:") == 1 and stderr.count("stopped after step") == 1, stderr
    resume = stderr.split("Resume with:\n", 1)[1].strip().splitlines()[0]
    assert resume.startswith("python -m gemzoo.cli launch --nproc-per-node 2 -- train --config")
    assert resume.endswith("--resume") and f"--out {out}" in resume
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    stop = next(e for e in events if e.get("event") == "interrupted")
    assert stop["signal"] == "SIGINT" and (out / "checkpoints" / f"step-{stop['step']:08d}").is_dir()
    assert "Resume with:" in (out / "train.log").read_text()
