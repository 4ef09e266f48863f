"""``gemzoo plan`` for configs/gem-bench.toml's tables at 8, 64, 1024 and 4096 ranks (groups of 8, one node, and
of 64 from 1024 ranks on), as one markdown table for the README; JSON to ``--out`` (or this folder) as
``plan_gem_bench.json``. The same figures as ``gemzoo plan --config configs/gem-bench.toml --world W --group G``.

    .venv/bin/python plugins/gemzoo-sharding-2d/bench/plan_table.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASES = [(8, 8), (64, 8), (1024, 8), (1024, 64), (4096, 8), (4096, 64)]


def main() -> None:
    from gemzoo_sharding_2d.scale import Links, describe_config, parse_bytes, plan_report

    from gemzoo.api import load_config

    cfg = load_config(str(HERE.parents[2] / "configs" / "gem-bench.toml"))
    desc = describe_config(cfg)
    reports = [plan_report(cfg, w, g, parse_bytes("141GB"), Links(), desc=desc) for w, g in CASES]
    print("| world | layout | G x R | tables + Adagrad a rank | a2a bytes a rank (ids + pooled fwd/bwd) | "
          "replica bytes | embedding comm time | total a rank (fits 141 GB) |")
    print("|---|---|---|---|---|---|---|---|")
    gb = lambda x: f"{x / 1e9:.3f} GB" if x >= 1e7 else f"{x / 1e6:.2f} MB"  # noqa: E731
    for rep in reports:
        for name, r in rep["layouts"].items():
            if name == "1d" and rep["group"] != 8 and any(x["world"] == rep["world"] and x["group"] == 8
                                                          for x in reports):
                continue  # the 1D row once per world
            if name != "1d" and r["replicas"] == 1:
                continue  # one group spans the world: 2D is 1D
            t, m, s = r["traffic"], r["memory"], r["seconds"]
            a2a = sum(t.get(k, 0) for k in ("a2a_ids", "a2a_pooled_fwd", "a2a_pooled_bwd"))
            replica = sum(t.get(k, 0) for k in ("replica_sync", "replica_all_gather", "replica_reduce_scatter"))
            print(f"| {rep['world']} | {name} | {r['group_size']} x {r['replicas']} | "
                  f"{gb(m['tables'] + m['optimizer_state'])} | {gb(a2a)} | {gb(replica)} | "
                  f"{(s['a2a'] + s['replica']) * 1e3:.2f} ms | {gb(m['total'])} ({'yes' if r['fits_hbm'] else 'no'}) |")
    dest = Path(sys.argv[1] if len(sys.argv) > 1 else HERE) / "plan_gem_bench.json"  # an output folder may be given
    dest.write_text(json.dumps(reports, indent=1))
    print(f"wrote {dest}", file=sys.stderr)


if __name__ == "__main__":
    main()
