"""``gemzoo config show|validate F``: the resolved config, or the assembly steps that need no weights."""

from __future__ import annotations

import json

from gemzoo.cli.common import load_run_config
from gemzoo.interfaces.precision import precision_report
from gemzoo.train.trainer import build_on_meta, configured


def cmd_config(args) -> int:
    cfg = load_run_config(args)
    model = build_on_meta(cfg)  # the dataset, the model on meta, attention per site, the precision policy
    if args.action == "validate":
        print(f"{args.config}: OK (dataset, model on meta, attention kernels and precision policy built)")
        return 0
    out = cfg.to_dict()
    out["precision_by_module"] = precision_report(model)
    out["memory_selection"] = memory_selection(cfg)
    print(json.dumps(out, indent=1, default=str))
    return 0


def memory_selection(cfg) -> dict:
    """Each memory policy's ``selection()`` (e.g. which saved tensors act-quant quantizes), if it has one."""
    out = {}
    for name in cfg.plugins.memory:
        selection = getattr(configured("memory", name, cfg), "selection", None)
        if callable(selection):
            out[name] = selection()
    return out
