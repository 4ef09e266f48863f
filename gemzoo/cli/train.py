"""``gemzoo train``: train from a config into a run folder; on SIGTERM or Ctrl-C, print the command that resumes."""

from __future__ import annotations

import json
import shlex
import sys

from gemzoo import registry
from gemzoo.cli.common import load_run_config
from gemzoo.train import run_folder
from gemzoo.train.loop import TrainingInterrupted
from gemzoo.train.metrics import json_safe
from gemzoo.train.trainer import train


def cmd_train(args) -> int:
    cfg = load_run_config(args)
    for name, info in registry.host().failed().items():  # one line each: the run goes on without them
        print(f"gemzoo: warning: plugin {name!r} ({info.distribution}) failed to load and is left out: {info.error}",
              file=sys.stderr)
    if args.out:
        cfg.run.out_dir = args.out
    elif isinstance(args.resume, str) and run_folder.run_folder_of(args.resume) is not None:
        cfg.run.out_dir = str(run_folder.run_folder_of(args.resume))  # --resume RUN_FOLDER continues it there
    resume = args.resume if args.resume is not None else False
    try:
        result = train(cfg, resume=resume, progress=not args.quiet, overwrite=args.overwrite)
    except (TrainingInterrupted, KeyboardInterrupt) as exc:
        argv = [a for a in getattr(args, "argv", sys.argv[1:]) if a != "--overwrite"]
        again = shlex.join(["gemzoo", *argv, *([] if args.resume is not None else ["--resume"])])
        if isinstance(exc, TrainingInterrupted):
            print(f"gemzoo: {exc.signal_name}: stopped after step {exc.step}; checkpoint "
                  f"{exc.checkpoint or cfg.run.out_dir}. Resume with:\n  {again}", file=sys.stderr)
            return 128 + exc.signum
        print(f"gemzoo: interrupted at once, without a checkpoint; resume from the last one with:\n  {again}",
              file=sys.stderr)
        return 130
    if result.is_main:
        summary = {"final_loss": result.final_loss, "steps": result.steps, **result.eval, **result.throughput,
                   "out_dir": str(result.out_dir)}
        print(json.dumps(json_safe(summary), allow_nan=False))
    return 0
