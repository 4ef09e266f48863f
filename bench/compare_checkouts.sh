#!/usr/bin/env bash
# The same ablation rows measured in two checkouts of gemzoo on one machine, alternating, so that a change's
# effect on end-to-end speed is read against the machine's own spread.
set -uo pipefail

usage() {
  cat <<'USAGE'
usage: bash bench/compare_checkouts.sh --base DIR --out DIR [--runs "a,b;c"] [--repeat N] [--steps N]
                                       [--ablation FILE] [--python PY]

Install the base checkout (editable, no C++ extension build, no network), train the ablation rows, then the
same for the checkout that holds this script, and repeat: base, this, base, this, ... Each pass writes
DIR/<base|this>-<i>/ (the ablation's report and run folders); DIR/compare.json and the table printed last hold
every row's figures and the ratio this/base of their means over the passes. The checkout left installed at the
end is this one.

  --base DIR       the other checkout (e.g. `git worktree add /tmp/base v0.1.0`)
  --out DIR        output folder (made if missing; an existing one must be empty)
  --runs "a;b"     ablation rows by name, separated by ';' (default: "jfa,bf16")
  --repeat N       passes over both checkouts (default 2)
  --steps N        steps a row (default: the ablation file's)
  --ablation FILE  ablation file, relative to each checkout (default configs/ablations/gem-bench.toml)
  --python PY      interpreter (default: $PYTHON or python3)
  -h, --help       this text

Example:
  git worktree add /tmp/gemzoo-base 847bdc2
  bash bench/compare_checkouts.sh --base /tmp/gemzoo-base --out runs/compare --runs "jfa,bf16" --repeat 2
USAGE
}

base="" out_dir="" runs="jfa,bf16" repeat=2 steps="" ablation=configs/ablations/gem-bench.toml py=${PYTHON:-python3}
while [ $# -gt 0 ]; do
  case "$1" in
    --base) base=${2:?--base needs a checkout}; shift ;;
    --out) out_dir=${2:?--out needs a folder}; shift ;;
    --runs) runs=${2:?--runs needs row names}; shift ;;
    --repeat) repeat=${2:?--repeat needs a number}; shift ;;
    --steps) steps=${2:?--steps needs a number}; shift ;;
    --ablation) ablation=${2:?--ablation needs a file}; shift ;;
    --python) py=${2:?--python needs an interpreter}; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "compare_checkouts.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$base" ] && [ -n "$out_dir" ] || { echo "compare_checkouts.sh: --base and --out are required (see --help)" >&2; exit 2; }
this=$(cd "$(dirname "$0")/.." && pwd)
base=$(cd "$base" 2>/dev/null && pwd) || { echo "compare_checkouts.sh: no checkout at --base" >&2; exit 2; }
[ -f "$base/pyproject.toml" ] || { echo "compare_checkouts.sh: $base is not a gemzoo checkout" >&2; exit 2; }
mkdir -p "$out_dir" && out_dir=$(cd "$out_dir" && pwd)
[ -z "$(ls -A "$out_dir")" ] || { echo "compare_checkouts.sh: $out_dir is not empty; give a new folder" >&2; exit 2; }

install() {  # install CHECKOUT: gemzoo and every plugin of that checkout, editable, offline
  local tree=$1 args=()
  for p in "$tree"/plugins/gemzoo-*/; do args+=(-e "${p%/}"); done
  GEMZOO_NO_EXTENSION=1 "$py" -m pip install -q --no-deps --no-build-isolation --no-index -e "$tree" "${args[@]}" \
    > "$out_dir/install.log" 2>&1 || { tail -20 "$out_dir/install.log"; return 1; }
}

IFS=';' read -r -a rows <<< "$runs"
for i in $(seq 1 "$repeat"); do
  for side in base this; do
    tree=$base; [ "$side" = this ] && tree=$this
    install "$tree" || exit 1
    dest="$out_dir/$side-$i"
    args=(ablate "$ablation" --out "$dest" --runs "${rows[@]}")
    [ -n "$steps" ] && args+=(--steps "$steps")
    echo "== $side pass $i ($(git -C "$tree" rev-parse --short HEAD 2>/dev/null || echo "$tree"))"
    (cd "$tree" && "$py" -m gemzoo.cli "${args[@]}") > "$dest.log" 2>&1
    echo "   exit $? ($(tail -1 "$dest.log" | cut -c1-160))"
  done
done

"$py" - "$out_dir" "$repeat" "$base" "$this" <<'PY'
import json, statistics, subprocess, sys
from pathlib import Path

out, repeat, base, this = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
KEYS = ("mean_samples_per_s", "mean_mfu", "max_step_s", "samples_per_s", "mfu", "step_s", "peak_mem_gib")
table = {}
for side in ("base", "this"):
    for i in range(1, repeat + 1):
        report = out / f"{side}-{i}" / "ablation.json"
        if not report.exists():
            continue
        for row in json.loads(report.read_text())["rows"]:
            cell = table.setdefault(row["name"], {}).setdefault(side, [])
            cell.append({k: row.get(k) for k in KEYS if row.get(k) is not None} | {"status": row.get("status")})

def commit(tree):
    try:
        return subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except Exception:
        return tree

summary = {"base": commit(base), "this": commit(this), "rows": table}
print(f"\n{'row':28} {'figure':20} {'base':>22} {'this':>22} {'this/base':>9}")
for name, sides in table.items():
    for key in KEYS:
        vals = {s: [p[key] for p in sides.get(s, []) if key in p] for s in ("base", "this")}
        if not vals["base"] or not vals["this"]:
            continue
        mb, mt = statistics.mean(vals["base"]), statistics.mean(vals["this"])
        summary.setdefault("ratios", {}).setdefault(name, {})[key] = mt / mb if mb else None
        fmt = lambda v: ", ".join(f"{x:.4g}" for x in v)
        print(f"{name:28} {key:20} {fmt(vals['base']):>22} {fmt(vals['this']):>22} {mt / mb:9.3f}")
(out / "compare.json").write_text(json.dumps(summary, indent=1))
PY
