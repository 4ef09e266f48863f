"""Generate the parts of docs/ that come from code, so they cannot drift from it.

    .venv/bin/python scripts/gen_docs.py            # rewrite docs/config.md and the examples in docs/kinds/*.md
    .venv/bin/python scripts/gen_docs.py --check    # exit 1 naming what is stale (tests/test_docs.py runs this)

- docs/config.md: every key of every config section, from the config dataclasses (type, default, allowed
  values, and the field's own comment as its one-line meaning): [run], [optim], [plugins], [precision],
  [eval], [checkpoint]; [model] per registered family, [data] per dataset, [plugins.options.NAME] per plugin
  of this repository that takes options; and the keys of ablation files.
- docs/kinds/<kind>.md: the block between ``<!-- example:begin -->`` and ``<!-- example:end -->`` is the
  implementation and hook that ``gemzoo new-plugin NAME --kind KIND`` writes (tested by tests/test_scaffold.py).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import re
import sys
import textwrap
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BEGIN, END = "<!-- example:begin -->", "<!-- example:end -->"
EXAMPLE_NAME = "my{kind}"


# ------------------------------------------------------------------------------------------------ config
# One line for keys whose dataclass field carries no comment (a comment in the code wins over these). The keys that
# name a kind's entry ([plugins] attention ..., [model] family, [data] source) come from gemzoo.kinds: kind_meanings().
MEANINGS = {
    "run": {
        "name": "the run's name (progress bar, logs)",
        "steps": "training steps in total (a resumed run continues up to this)",
        "seed": "seeds the model init, the data stream and dropout",
        "out_dir": "the run folder: metrics.jsonl, checkpoints/ (--out overrides)",
        "device": "where to train; auto picks cuda when available",
        "log_every": "write a metrics.jsonl row (and a progress line) every N steps",
        "compile": "torch.compile the model",
    },
    "optim": {
        "lr": "AdamW learning rate of the dense parameters",
        "weight_decay": "AdamW weight decay",
        "sparse_lr": "Adagrad learning rate of the embedding tables",
        "warmup_steps": "linear learning-rate warm-up over the first N steps",
    },
    "precision": {"keep": "fnmatch patterns of module names the precision policy leaves in bf16, e.g. [\"head.*\"]"},
    "eval": {"batches": "held-out batches per evaluation"},
    "model": {
        "d_model": "transformer width",
        "num_layers": "transformer blocks",
        "num_heads": "attention heads",
        "head_dim": "width of one head",
        "ffn_mult": "feed-forward width as a multiple of d_model",
        "embedding_dim": "item (and sparse table) embedding width",
        "mlp_dims": "hidden widths of the task MLP",
        "dropout": "dropout probability",
        "conversion_weight": "weight of the conversion loss beside the click loss",
        "num_negatives": "sampled negatives per positive (sampled softmax)",
        "temperature": "softmax temperature of the sampled-softmax loss",
        "eval_ks": "cut-offs K of HR@K and NDCG@K",
        "init_std": "standard deviation of the weight init",
    },
    "data": {
        "path": "the MovieLens ratings.dat to read (UserID::MovieID::Rating::Timestamp)",
        "batch_size": "users (samples) per training batch",
        "max_len": "longest history kept per user (longer ones keep their latest events)",
        "len_sigma": "sigma of the log-normal history lengths",
        "min_candidates": "fewest candidates a user gets",
        "num_items": "item vocabulary size",
        "num_sparse_tables": "pooled sparse feature tables",
        "sparse_table_size": "rows per sparse table",
        "num_clusters": "item clusters the planted user interests are drawn from",
        "favourite_clusters": "clusters each user favours",
        "planted_rank": "rank of the planted user-item affinity",
        "sparse_weight": "weight of the sparse features in the planted labels",
        "click_bias": "logit offset of the planted click probability",
        "eval_seed_offset": "seed offset of the held-out stream (disjoint from training batches)",
    },
    "ablation": {
        "config": "the config every run trains (relative to the working directory)",
        "runs": "plugin sets, one run each, as --plugins takes them (e.g. \"jfa,bf16\"), or tables "
                "{ plugins = \"...\", set = [overrides of this run], name = \"...\" }; names are unique",
        "steps": "steps per run (gemzoo ablate --steps overrides)",
        "warmup": "first steps left out of the throughput medians",
        "set": "--set overrides applied to every run",
    },
}


def kind_meanings() -> dict[str, dict[str, str]]:
    """Config section -> {key naming a kind's entry: its meaning}, from the kinds table's descriptions."""
    from gemzoo import kinds

    out: dict[str, dict[str, str]] = {}
    for k in kinds.KINDS:
        section, _, key = k.config_key.rpartition(".")
        which = f"a list of the {k.description}" if k.many else f"one of the {k.description}"
        page = f"docs/kinds/{k.name}.md" if (DOCS / "kinds" / f"{k.name}.md").is_file() else None
        out.setdefault(section, {})[key] = f"{which}: `gemzoo list {k.name}`{', ' + page if page else ''}"
    return out


def field_comments(cls) -> dict[str, str]:
    """Field name -> its comment, searched through ``cls`` and the dataclasses it inherits fields from."""
    out: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            out.update(_own_field_comments(base))
    return out


def _own_field_comments(cls) -> dict[str, str]:
    """Field name -> its comment: the trailing ``# ...`` on its line, else the comment lines just above it."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    out = {}
    body = ast.parse(source).body[0].body
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        text = comments.get(node.lineno, "")
        if not text:
            above, n = [], node.lineno - 1
            while n >= 1 and lines[n - 1].strip().startswith("#"):
                above.insert(0, comments.get(n, ""))
                n -= 1
            text = " ".join(above)
        if text:
            out[node.target.id] = text
    return out


def _type(f: dataclasses.Field) -> str:
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return t.replace("typing.", "")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    return _toml(value)


def _toml(value) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{}" if not value else "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _allowed(f: dataclasses.Field) -> str:
    meta = f.metadata or {}
    parts = []
    length = meta.get("length")
    if length is not None:
        lo, hi = (length, length) if isinstance(length, int) else length
        parts.append(f"{lo} values" if lo == hi else (f"at least {lo} value(s)" if not hi else f"{lo} to {hi} values"))
    bounds = [f"{op} {meta[key]:g}" if isinstance(meta[key], float) else f"{op} {meta[key]}"
              for key, op in (("min", ">="), ("max", "<="), ("below", "<")) if meta.get(key) is not None]
    if bounds:
        parts.append(("each " if length is not None else "") + ", ".join(bounds))
    if meta.get("choices"):
        parts.append("one of " + ", ".join(_toml(c) for c in meta["choices"]))
    if meta.get("pattern"):
        parts.append(meta.get("means") or f"matches `{meta['pattern']}`")
    return "; ".join(parts)


def section_table(cls, scope: str, skip: tuple[str, ...] = ()) -> list[str]:
    notes = {**MEANINGS.get(scope, {}), **kind_meanings().get(scope, {}), **field_comments(cls)}
    rows = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        meaning = notes.get(f.name, "").replace("|", "\\|")
        rows.append(f"| `{f.name}` | `{_type(f)}` | `{_default(f)}` | {_allowed(f)} | {meaning} |")
    return rows


def _doc_line(obj) -> str:
    doc = inspect.getdoc(obj) or ""
    return doc.split("\n\n")[0].replace("\n", " ").strip()


def in_this_repo(distribution: str) -> bool:
    """Core, or a plugin committed under plugins/ (an installed work-in-progress folder does not count)."""
    if distribution == "gemzoo":
        return True
    pyproject = ROOT / "plugins" / distribution / "pyproject.toml"
    if not pyproject.is_file():
        return False
    import subprocess

    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)

    try:
        top = git("rev-parse", "--show-toplevel")
        if top.returncode or Path(top.stdout.strip()).resolve() != ROOT.resolve():
            return True  # not a git checkout of its own (an sdist, an archive, an export inside another repo)
        return git("ls-files", "--error-unmatch", str(pyproject.relative_to(ROOT))).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return True


def config_reference() -> str:
    from gemzoo import config, kinds, registry

    out = [
        "# Config reference",
        "",
        "<!-- Generated by scripts/gen_docs.py from the config dataclasses; do not edit. "
        "tests/test_docs.py fails when it is stale. -->",
        "",
        "A config is a TOML file (examples in `configs/`). Unknown keys and sections are errors that name the "
        "valid ones; `--set SECTION.KEY=VALUE` overrides any key from the command line (the value is read as "
        "TOML, e.g. `--set model.mlp_dims=[256,128]`); `--plugins a,b` sets the `[plugins]` slots by name. "
        "`gemzoo config show F` prints the resolved config.",
        "",
        "Every value is checked against the column *allowed* (a list's length and each element's range), its "
        "type (a list's element type too), and no float may be NaN or infinite; rules between keys (such as "
        "`[data] median_len <= max_len`) are the section's own. The dataclasses are the one schema: "
        "`gemzoo config validate F` refuses exactly what `gemzoo train` refuses, with the same message.",
        "",
    ]
    titles = {"run": "the run", "optim": "optimizers (dense AdamW, sparse Adagrad)", "precision":
              "selective precision", "eval": "held-out evaluation", "checkpoint": "atomic checkpoints"}
    for name, cls in config.SECTIONS.items():
        out += [f"## [{name}]: {titles.get(name, name)}", "", *section_table(cls, name), ""]
    lists = [k.slot for k in kinds.plugin_kinds() if k.many]
    out += [f"## [plugins]: one plugin per slot ({', '.join(lists)} {'takes' if len(lists) == 1 else 'take'} a list)",
            "",
            "Each value is a registered name (`gemzoo list KIND`); see the kind pages in `docs/kinds/`.", "",
            *section_table(config.PluginsConfig, "plugins", skip=("options",)), "",
            "`[plugins.options.NAME]` configures plugin NAME with the keys of its own options dataclass "
            "(below); `[plugins.attention_sites]`-style per-site choices are described in the model's docs.", ""]

    # The kinds named outside [plugins] ([model] family, [data] source): one section each, one table per entry.
    for k in kinds.KINDS:
        if k.in_plugins:
            continue
        section = k.config_key.rpartition(".")[0]
        out += [f"## [{section}]: per {k.slot}", "",
                f"`{k.slot}` picks one of the {k.description} (`gemzoo list {k.name}`); the other keys are its own.",
                ""]
        for name in registry.names(k.name):
            spec = registry.get(k.name, name)
            entry = registry.find(name)
            if entry is not None and not in_this_repo(entry.distribution):
                continue
            out += [f"### {k.slot} = \"{name}\"", "", spec.description or _doc_line(spec.config_cls), "",
                    *section_table(spec.config_cls, section), ""]
    options = []
    for entry in sorted(registry.entries(), key=lambda e: (e.kind, e.name)):
        cls = getattr(entry.obj, "options_cls", None)
        if cls is not None and in_this_repo(entry.distribution):
            options.append((entry, cls))
    out += ["## [plugins.options.NAME]: plugin options", ""]
    if not options:
        out += ["No plugin of this repository takes options.", ""]
    for entry, cls in options:
        where = "built in" if entry.distribution == "gemzoo" else f"`plugins/{entry.distribution}`"
        readme = "gemzoo/builtin/" if entry.distribution == "gemzoo" else f"plugins/{entry.distribution}/README.md"
        out += [f"### [plugins.options.{entry.name}] ({entry.kind}, {where})", "",
                f"Described in `{readme}`.", "", *section_table(cls, "options"), ""]
    out += ["## Ablation files (`configs/ablations/*.toml`, run by `gemzoo ablate`)", "",
            _doc_line(config.Ablation), "", *section_table(config.Ablation, "ablation"), ""]
    return "\n".join(out).rstrip() + "\n"


# ------------------------------------------------------------------------------------------------ kinds
def kind_example(kind: str) -> str:
    from gemzoo.cli.new_plugin import module_name, render, template

    name = EXAMPLE_NAME.format(kind=kind)
    files = render(name, kind)
    mod = module_name(name)
    impl = f"{mod}/{template(kind)['impl']}.py"
    parts = [BEGIN, "",
             f"What `gemzoo new-plugin {name} --kind {kind}` writes (and `tests/test_scaffold.py` installs and "
             "tests in CI). The implementation, which works as generated:", "",
             f"```python\n# {impl}\n{files[impl].rstrip()}\n```", "",
             "The hook that registers it:", "",
             f"```python\n# {mod}/plugin.py\n{files[f'{mod}/plugin.py'].rstrip()}\n```", "",
             "Its tests:", "",
             f"```python\n# tests/test_{mod}.py\n{files[f'tests/test_{mod}.py'].rstrip()}\n```", "", END]
    return "\n".join(parts)


def with_example(page: str, kind: str) -> str:
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pattern.search(page):
        raise SystemExit(f"docs/kinds/{kind}.md has no {BEGIN} ... {END} block")
    return pattern.sub(lambda _: kind_example(kind), page, count=1)


def expected() -> dict[Path, str]:
    from gemzoo.cli.new_plugin import KINDS

    files = {DOCS / "config.md": config_reference()}
    for kind in KINDS:
        path = DOCS / "kinds" / f"{kind}.md"
        files[path] = with_example(path.read_text(), kind)
    return files


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a generated part is stale")
    args = p.parse_args()
    stale = []
    for path, text in expected().items():
        current = path.read_text() if path.is_file() else None
        if current != text:
            stale.append(path.relative_to(ROOT))
            if not args.check:
                path.write_text(text)
    if args.check and stale:
        print(f"stale: {', '.join(map(str, stale))}; regenerate with: .venv/bin/python scripts/gen_docs.py")
        return 1
    print(("rewrote " + ", ".join(map(str, stale))) if stale else "docs are current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
