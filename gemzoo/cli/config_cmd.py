"""``gemzoo config show|validate F``: the resolved config, or the assembly steps that need no weights."""

from __future__ import annotations

import json

from gemzoo.cli.common import load_run_config
from gemzoo.interfaces.precision import precision_report
from gemzoo.train.trainer import build_on_meta, configured


def cmd_config(args) -> int:
    cfg = load_run_config(args)
    missing: list[str] = []  # a data file that is not there yet: the rest is still checked
    model = build_on_meta(cfg, without_data=missing)  # dataset, model on meta, attention per site, precision
    if args.action == "validate":
        if missing:
            print(f"{args.config}: OK without the data (model on meta from nominal sizes, attention kernels and "
                  f"precision policy built); train needs it: {missing[0]}")
        else:
            print(f"{args.config}: OK (dataset, model on meta, attention kernels and precision policy built)")
        return 0
    out = cfg.to_dict()
    if missing:
        out["data_not_found"] = missing[0]
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
