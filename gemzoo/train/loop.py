"""The step loop of an assembled run: launch steps, read their numbers at each sync point, log, evaluate,
checkpoint, and stop cleanly on SIGTERM or Ctrl-C.

Steps are *launched* (``StepLoop.launch_step``: load, forward, backward, optimizers, nothing read from the device)
and *finished* together (``StepLoop.finish_steps``: one read of every queued loss and log) at each sync point:
every step with ``run.sync = "step"``; with ``"log"`` only steps that write a row, evaluate, checkpoint, end the
run or stop.
"""

from __future__ import annotations

import math
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gemzoo import kinds, registry
from gemzoo.config import Config
from gemzoo.data.lookahead import Lookahead
from gemzoo.distributed import World, all_reduce_gradients, clip_grad_norm
from gemzoo.distributed import state as dstate
from gemzoo.distributed.comms_groups import comms_summary
from gemzoo.errors import TrainingError
from gemzoo.interfaces.batching import DataParallelGroup
from gemzoo.interfaces.memory import policy_report
from gemzoo.interfaces.models import host_view
from gemzoo.train import checkpoint as ckpt
from gemzoo.train import run_folder
from gemzoo.train.compiles import CompileWatch
from gemzoo.train.console import RunLog, attached, eval_line, log_line, progress_bar, short_info
from gemzoo.train.metrics import (
    MetricsLog,
    Throughput,
    last_step_row,
    peak_memory_bytes,
    reduce_across_ranks,
    step_metrics,
    stretch_metrics,
)
from gemzoo.train.optim import lr_factor
from gemzoo.train.tensorboard import maybe_tensorboard


@dataclass
class TrainResult:
    final_loss: float | None  # None when no step ran and none was logged (e.g. resuming a finished run)
    steps: int
    eval: dict[str, float] = field(default_factory=dict)
    out_dir: Path | None = None
    history: list[dict] = field(default_factory=list)
    is_main: bool = True  # rank 0 (the one that logs and prints)
    # the run's throughput over wall-clock time after warm-up (gemzoo.train.metrics.Throughput.summary) and the
    # compiles after warm-up; {} when fewer steps than run.warmup ran
    throughput: dict[str, float] = field(default_factory=dict)


@dataclass
class LaunchedStep:
    """A step queued on the device: its loss and logs still tensors, its counts read on the host."""

    step: int
    loss: torch.Tensor
    logs: dict[str, Any]
    share: float
    sums: dict[str, float]
    grad_norm: torch.Tensor | None = None  # the dense gradients' global norm, before clipping
    lr: float | None = None  # the dense optimizer's learning rate this step


class TrainingInterrupted(Exception):
    """SIGTERM or SIGINT stopped the run after a step; a checkpoint of that step was written."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None, out_dir: Path):
        self.signum, self.step, self.checkpoint, self.out_dir = signum, step, checkpoint, out_dir
        self.signal_name = signal.Signals(signum).name
        super().__init__(f"stopped by {self.signal_name} after step {step}; checkpoint "
                         f"{checkpoint or out_dir / 'checkpoints'} written; continue with --resume")


class StopSignals:
    """While active (main thread only), SIGTERM and SIGINT ask the loop to stop after the current step.

    A second Ctrl-C stops at once (KeyboardInterrupt). With several ranks the request is agreed on by an
    all-reduce every step, so every rank stops after the same step and writes the same checkpoint."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, world: World, device: torch.device):
        self.world, self.device = world, device
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.signum = signum
        if self.world.is_main:  # one message, not one per rank
            print(f"\ngemzoo: {signal.Signals(signum).name}: finishing this step, then writing a checkpoint "
                  "(Ctrl-C again stops at once, without one)", file=sys.stderr, flush=True)

    def requested(self) -> int | None:
        """The signal that asked to stop, agreed on by every rank; None to go on."""
        if self.world.world_size <= 1:
            return self.signum
        # on the CPU over gloo (World.host_group): agreed on without waiting for the GPU's queue
        flag = torch.tensor([self.signum or 0], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.world.host_group)
        return int(flag.item()) or None


def loss_terms(batch) -> int:
    """How many terms the model's loss is the mean of on ``batch``: gem's candidates, retrieval's positions with
    a target, else its samples. With several ranks each rank's loss is weighted by its share of the global count,
    so the update is that of the global batch's loss whatever the split."""
    n = getattr(batch, "num_candidates", None)
    targets = getattr(batch, "targets", None)
    if n is None and isinstance(targets, torch.Tensor):
        n = int((targets >= 0).sum())
    return int(batch.num_samples if n is None else n)


class StepLoop:
    """What a run does once assembled (``Trainer`` assembles one): ``fit`` runs the loop. It reads the attributes
    the assembly sets, listed here."""

    cfg: Config
    out_dir: Path
    progress: bool
    hook: Any  # the plugin manager's hook relay (gemzoo_step_end)
    world: World
    device: torch.device
    peak: float
    peak_source: str
    comms: Any
    planner: Any
    precision: Any
    memory: list
    dataset: Any
    lookahead: Lookahead
    model: nn.Module
    forward: Callable
    optimizers: dict[str, torch.optim.Optimizer]
    replicated_params: list[nn.Parameter]
    dense_params: list[nn.Parameter]
    start_step: int
    resume_changes: list[tuple[str, Any, Any]]
    run_log: RunLog | None = None  # train.log on rank 0, opened by the assembly
    banner_text: str = ""

    def say(self, message: str, *, err: bool = False) -> None:
        """Print on rank 0 only."""
        if self.world.is_main:
            print(message, file=sys.stderr if err else sys.stdout, flush=True)

    # ----------------------------------------------------------------------------------------
    def train_step(self, step: int) -> dict[str, float]:
        """One step, waited for: its metrics (``run.sync = "step"``'s unit; ``fit`` may queue several)."""
        t0 = self._mark()
        launched = self.launch_step(step)
        self._wait()
        return self.finish_steps([launched], time.perf_counter() - t0)[0]

    def _reduce_host(self, values: dict[str, float], op: str) -> dict[str, float]:
        """Numbers the host holds, reduced over every rank without waiting for the device (World.host_group)."""
        return reduce_across_ranks(values, op, torch.device("cpu"), self.world.host_group)

    def _mark(self) -> float:
        """The start of a timed stretch: the device's queue drained, the clock read."""
        self._wait()
        return time.perf_counter()

    def _wait(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def launch_step(self, step: int) -> LaunchedStep:
        """Queue one step's work (load, forward, backward, optimizers) without waiting for the device: nothing
        here reads a device value on one rank (the loss and logs stay tensors), so the host may run ahead.
        ``finish_steps`` reads them. The step's time runs from the previous step's end to its end, loading this
        rank's samples included, as MFU's definition asks (the next part is built on a host thread meanwhile)."""
        cfg = self.cfg
        # This rank loads its own part of the global batch; the batching policy, given the model's per-sample
        # costs and the data-parallel group, returns the samples this rank trains. A policy with overlap = True
        # gets the next step's partition computed in a worker (thread or process) while this step trains
        # (collectives stay here; the samples are the same as without: gemzoo.data.lookahead.Lookahead).
        dp_mesh = self.world.dp_mesh
        dp = DataParallelGroup() if dp_mesh is None else DataParallelGroup(
            dp_mesh.get_local_rank(), dp_mesh.size(), dp_mesh.get_group(), host=self.world.dp_host)
        batch = self.lookahead.batch(self.dataset, step, dp, self.device,
                                     lambda part: self.model.cost_model(part),  # looked up only with >1 rank
                                     next_step=step + 1 if step + 1 < cfg.run.steps else None,
                                     last_step=cfg.run.steps - 1)
        # The loss is the global batch's: sum-then-divide by the global count of loss terms. Gradients are
        # averaged over ranks, so rank r scales its mean loss by world * terms_r / terms (1.0 for even splits).
        world = self.world.world_size
        share = 1.0
        if world > 1:
            terms = loss_terms(host_view(batch))  # retrieval counts its targets: from the host copy
            got = self._reduce_host({"terms": terms, "empty": float(terms == 0)}, "sum")
            total = got["terms"]
            if got["empty"]:  # every rank raises, none waits in a collective
                raise TrainingError(f"{int(got['empty'])} of {world} ranks have no loss terms to train at step "
                                    f"{step} (the global batch has {int(total)}); raise data.batch_size to at least "
                                    f"{world}, or use a batching policy that gives every rank samples")
            share = world * terms / total
        for opt in self.optimizers.values():
            for group in opt.param_groups:
                group.setdefault("base_lr", group["lr"])
                group["lr"] = group["base_lr"] * lr_factor(step, cfg)
        self.model.train()
        contexts = [p.step_context() for p in self.memory]
        for c in contexts:
            c.__enter__()
        try:
            out = self.forward(batch)
            loss = out.loss  # checked once the step is done: a check here would wait for the forward
            (loss if share == 1.0 else loss * share).backward()
        finally:
            for c in reversed(contexts):
                c.__exit__(None, None, None)
        all_reduce_gradients(self.replicated_params, self.world)
        # the norm is computed either way (logged as grad_norm); an infinite threshold clips nothing
        grad_norm = clip_grad_norm(self.dense_params, cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf)
        lr = next((g["lr"] for opt in self.optimizers.values() for g in opt.param_groups), None)
        for opt in self.optimizers.values():
            opt.step()
            opt.zero_grad(set_to_none=True)
        self.planner.sync(self.model, step)  # e.g. replica groups of 2D sharding average their tables
        after = getattr(self.precision, "after_optimizer_step", None)
        if after is not None:
            after(self.model)
        # what the step's numbers need, read from the host copy of the batch (no device sync)
        host = host_view(batch)
        sums = {"samples": batch.num_samples, "tokens": host.num_tokens, "flops": self.model.flops(host)}
        return LaunchedStep(step, loss.detach(), {k: v.detach() if isinstance(v, torch.Tensor) else v
                                               for k, v in out.logs.items()}, share, sums,
                            grad_norm=grad_norm.detach(), lr=lr)

    def finish_steps(self, launched: list[LaunchedStep], seconds: float) -> list[dict[str, float]]:
        """The metrics of steps queued by ``launch_step`` once the device has run them; ``seconds``: each
        step's time (the stretch's mean when several were queued). Raises at the first non-finite loss.

        Several ranks: the loss (and the model's logs) is the global batch's, each rank's weighted by its share
        of the loss terms, the objective the averaged gradients descend; throughput counts every rank's
        samples, tokens and FLOPs over the slowest rank's time; MFU is against the peak of all devices; memory
        is the largest rank's."""
        cfg, world = self.cfg, self.world.world_size
        # one read for every queued value
        norm = [s.grad_norm if s.grad_norm is not None else torch.tensor(math.nan) for s in launched]
        values = [torch.as_tensor(v).detach().reshape(()).to("cpu", torch.float64)
                  for s, n in zip(launched, norm, strict=True) for v in (s.loss, n, *s.logs.values())]
        flat = iter(torch.stack(values).tolist() if values else [])
        results = []
        for s in launched:
            means = {"loss": next(flat)}
            grad_norm = next(flat)  # the same on every rank: the global norm of the averaged gradients
            means.update({f"train/{k}": next(flat) for k in s.logs})
            means = {k: v * s.share for k, v in means.items()}  # weighted by the rank's share of the loss terms
            sums = dict(s.sums)
            # the ranks of a tensor-parallel group train the same samples: each counts 1/copies of them
            if self.world.copies > 1:
                sums = {k: v / self.world.copies for k, v in sums.items()}
            maxes = {"seconds": seconds, "peak_mem_bytes": peak_memory_bytes(self.device)}
            if world > 1:
                means = {k: v / world for k, v in self._reduce_host(means, "sum").items()}
                sums = self._reduce_host(sums, "sum")
                maxes = self._reduce_host(maxes, "max")
            if not math.isfinite(means["loss"]):  # the global loss, so every rank stops here together
                raise TrainingError(
                    f"loss is {means['loss']} at step {s.step}. Lower optim.lr (now {cfg.optim.lr}), set "
                    f"optim.grad_clip, or try precision = \"fp32\"; no checkpoint of it is written: "
                    f"{ckpt.last_checkpoint_note(self.out_dir / run_folder.CHECKPOINTS)}.")
            metrics = step_metrics(loss=means.pop("loss"), seconds=maxes["seconds"], samples=int(sums["samples"]),
                                   tokens=int(sums["tokens"]), flops=sums["flops"], peak_flops=self.peak * world,
                                   device=self.device, peak_mem_bytes=maxes["peak_mem_bytes"])
            metrics.update({"lr": math.nan if s.lr is None else s.lr, "grad_norm": grad_norm})
            metrics.update(means)
            results.append(metrics)
        return results

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.model.eval()
        evaluator = self.model.evaluator()
        for batch in self.dataset.eval_batches(self.cfg.eval.batches):
            evaluator.update(batch.to(self.device))
        self.model.train()
        return {f"eval/{k}": float(v) for k, v in evaluator.compute().items()}

    def check_finite_state(self, step: int) -> None:
        """NonFiniteState on every rank when any rank's parameters or optimizer state hold NaN or infinity (a
        finite loss does not prove finite parameters): a checkpoint is committed only from finite state."""
        local = {f"model.{k}": v for k, v in self.model.state_dict().items()}
        for name, opt in self.optimizers.items():
            for pid, pstate in opt.state_dict()["state"].items():
                local.update({f"optim-{name}.{pid}.{k}": v for k, v in pstate.items() if isinstance(v, torch.Tensor)})
        bad = ckpt.nonfinite_tensors(local)
        counts = [len(bad), ckpt.count_floating(local)]
        if self.world.world_size > 1:
            flags = torch.tensor(counts, device=self.device, dtype=torch.int64)
            dist.all_reduce(flags)
            counts = flags.tolist()
        if counts[0]:
            bad += [f"{counts[0] - len(bad)} on other ranks"] if counts[0] > len(bad) else []
            raise ckpt.nonfinite_state(step, bad, counts[1], self.out_dir / run_folder.CHECKPOINTS)

    def save(self, step: int) -> Path | None:
        self.check_finite_state(step)
        # Whole tensors on rank 0, whatever the layout (collectives: every rank takes part).
        model_state = dstate.gather_full_state(self.model.state_dict(), self.world.is_main,
                                               dstate.rank_row_names(self.model))
        planner_state = self.planner.state_dict(self.model)
        optimizer_states = {n: dstate.gather_optimizer_state(o.state_dict(), dstate.optimizer_rank_rows(o))
                            for n, o in self.optimizers.items()}
        if not self.world.is_main:
            return None
        plugins = {e.name: {"kind": e.kind, "distribution": e.distribution, "version": e.version}
                   for e in registry.entries() if e.name in self._selected_names()}
        manifest = {"config": self.cfg.to_dict(), "plugins": plugins, "torch": torch.__version__}
        return ckpt.save_checkpoint(
            self.out_dir / "checkpoints", step,
            model_state=model_state,
            optimizers=optimizer_states, planner_state=planner_state,
            manifest=manifest, keep=self.cfg.checkpoint.keep,
        )

    def memory_reports(self) -> dict[str, dict]:
        """What each memory policy reports it did (bytes saved per step, chosen budget, ...); {} entries dropped."""
        reports = {n: policy_report(p) for n, p in zip(self.cfg.plugins.memory, self.memory, strict=True)}
        return {n: r for n, r in reports.items() if r}

    def log_memory_reports(self, log: MetricsLog | None) -> None:
        reports = self.memory_reports()
        if not reports or not self.world.is_main:
            return
        if log:
            log.write({"event": "memory", **reports})
        for name, r in reports.items():
            summary = r.get("summary")
            if summary:
                print(f"{name}: {summary}", flush=True)

    def _selected_names(self) -> set[str]:
        return {name for names in kinds.selected(self.cfg.plugins).values() for name in names}

    # ----------------------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        """Train to ``run.steps``; ``train.log`` (opened by the assembly) is closed when it returns or raises."""
        try:
            if self.banner_text and self.progress:  # --quiet: no banner either
                self.say(self.banner_text)
            return self._fit()
        finally:
            if self.run_log is not None:
                self.run_log.close()

    def _fit(self) -> TrainResult:
        cfg = self.cfg
        # 11. Loop: step; metrics; eval; atomic checkpoint.
        peak_source = self.peak_source
        main = self.world.is_main
        metrics_path = self.out_dir / run_folder.METRICS
        log = MetricsLog(metrics_path, append=self.start_step > 0) if main else None
        log = maybe_tensorboard(log, cfg, self.out_dir, self.start_step)  # run.tensorboard: rows as scalars too
        if log:
            mesh = self.world.mesh
            log.write({"event": "resume" if self.start_step > 0 else "start", "step": self.start_step,
                       "device": str(self.device), "world_size": self.world.world_size,
                       "mesh": None if mesh is None else {"shape": list(mesh.mesh.shape),
                                                          "dims": list(mesh.mesh_dim_names or ())},
                       **({} if self.world.dense_mesh is None else {"dense_mesh": {
                           "shape": list(self.world.dense_mesh.mesh.shape),
                           "dims": list(self.world.dense_mesh.mesh_dim_names)}}),
                       "peak_flops": self.peak, "mfu_peak": peak_source, "attention": cfg.plugins.attention,
                       "precision": cfg.plugins.precision, "memory": cfg.plugins.memory,
                       "comms": comms_summary(cfg.plugins.comms, self.comms, mesh),
                       **({"changed": {k: [o, n] for k, o, n in self.resume_changes}} if self.resume_changes else {})})
        if self.start_step >= cfg.run.steps:
            return self._already_done(log, metrics_path)
        history, last_eval, loss = [], {}, math.nan
        show = self.progress and main
        lines = show and not sys.stdout.isatty()  # batch jobs: a plain line every run.log_every steps
        progress = progress_bar(show and not lines, self.run_log.terminal if self.run_log else None)
        t_start = time.perf_counter()
        throughput = Throughput(min(cfg.run.warmup, cfg.run.steps - self.start_step - 1))
        watch = CompileWatch().start()
        if throughput.warmed_up:
            watch.arm()
        with progress, attached(progress, self.run_log), StopSignals(self.world, self.device) as stop, \
                self.lookahead, watch:
            task = progress.add_task(cfg.run.name, total=cfg.run.steps, completed=self.start_step, info="")
            # Steps are queued (launch_step) and read together (finish_steps) at each *point*: every step with
            # run.sync = "step"; with "log" only steps that write a row, evaluate, checkpoint, end the run or stop.
            queued, since_row, t_mark = [], [], self._mark()
            for step in range(self.start_step, cfg.run.steps):
                queued.append(self.launch_step(step))
                done = step + 1
                last = done == cfg.run.steps
                evaluated = cfg.eval.every > 0 and (done % cfg.eval.every == 0 or last)
                logged = done % cfg.run.log_every == 0 or last
                checkpointed = cfg.checkpoint.every > 0 and (done % cfg.checkpoint.every == 0 or last)
                signum = None if cfg.run.sync == "step" else stop.requested()  # a stop request makes a point
                if not (cfg.run.sync == "step" or logged or evaluated or checkpointed or last or signum):
                    continue
                self._wait()
                seconds = (time.perf_counter() - t_mark) / len(queued)
                finished = self.finish_steps(queued, seconds)
                for m in finished:
                    was_warm = throughput.warmed_up
                    throughput.add(m)
                    if throughput.warmed_up and not was_warm:
                        watch.arm()  # compiles from here on are stalls in the measured steps
                compiles = watch.after_warmup
                for event in watch.new_events():
                    self.say(f"warning: {event}", err=True)
                since_row.extend(finished)
                for s, metrics in zip(queued, finished, strict=True):
                    at = s.step + 1
                    loss = metrics["loss"]
                    if at == done and evaluated:
                        with watch.excluded():  # eval's own graph is no stall of the training steps
                            last_eval = self.evaluate()
                        metrics.update(last_eval)
                    record = {"step": at, **metrics, "mfu_peak": peak_source}
                    history.append(record)
                    if at == done and log and (logged or evaluated):
                        # the row's throughput is its own steps' (every step since the last row), over their time
                        log.write({**record, **stretch_metrics(since_row), "compiles_after_warmup": compiles})
                        since_row = []
                    if at == done and show and (logged or evaluated):
                        eta = (time.perf_counter() - t_start) / (done - self.start_step) * (cfg.run.steps - done)
                        row = log_line(done, cfg.run.steps, metrics, eta)
                        if lines:
                            print(row, flush=True)
                        else:  # the bar stands for the row on screen; the log keeps it
                            if self.run_log is not None:
                                self.run_log.note(row)
                            if evaluated:  # stays on screen above the bar
                                print(eval_line(done, cfg.run.steps, metrics), flush=True)
                    self.hook.gemzoo_step_end(trainer=self, step=at, metrics=metrics)
                queued = []
                saved = self.save(done) if checkpointed else None
                progress.update(task, completed=done, info=short_info(metrics))
                signum = signum or stop.requested()  # one asked for meanwhile (by a step-end hook, say)
                if signum and done < cfg.run.steps:
                    if saved is None:
                        saved = self.save(done)
                    if log:
                        log.write({"event": "interrupted", "step": done, "signal": signal.Signals(signum).name})
                        log.close()
                    raise TrainingInterrupted(signum, done, saved, self.out_dir)
                t_mark = self._mark()
        self.log_memory_reports(log)
        summary = throughput.summary()
        if summary:
            summary["compiles_after_warmup"] = watch.after_warmup
        if log:
            log.write({"event": "end", "step": cfg.run.steps, "final_loss": loss, **last_eval, **summary})
            log.close()
        return TrainResult(loss, cfg.run.steps, last_eval, self.out_dir, history, main, summary)

    def _already_done(self, log: MetricsLog | None, metrics_path: Path) -> TrainResult:
        """Resuming a run that has reached run.steps: nothing to train; report its last logged numbers."""
        steps = self.cfg.run.steps
        self.say(f"nothing to train: the run in {self.out_dir} is at step {self.start_step} and run.steps is "
                 f"{steps}; pass --steps N (N > {self.start_step}) to train further")
        row = last_step_row(metrics_path, self.start_step) if self.world.is_main else None
        evals = {k: v for k, v in (row or {}).items() if k.startswith("eval/")}
        loss = row.get("loss") if row else None
        if log:
            log.write({"event": "end", "step": steps, "final_loss": loss, **evals})
            log.close()
        return TrainResult(loss, steps, evals, self.out_dir, [], self.world.is_main)
