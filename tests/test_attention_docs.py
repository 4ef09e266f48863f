"""docs/attention.md's mask pictures are what gemzoo computes (the docs cannot drift from the code)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gemzoo.attention import allowed_mask

DOC = Path(__file__).resolve().parents[1] / "docs" / "attention.md"


def _pictures():
    blocks = re.findall(r"```\n(causal=.*?)```", DOC.read_text(), flags=re.S)
    out = []
    for block in blocks:
        header, _, *rows = block.strip("\n").split("\n")
        opts = dict(kv.split("=") for kv in header.split())
        grid = [[c == "x" for c in row.split(":", 1)[1].split()] for row in rows]
        out.append(pytest.param(opts, grid, id=header.replace(" ", "-")))
    return out


def test_the_doc_has_the_pictures():
    assert len(_pictures()) >= 5


@pytest.mark.parametrize("opts,grid", _pictures())
def test_mask_picture_matches_allowed_mask(opts, grid):
    lq, lk = int(opts["Lq"]), int(opts["Lk"])
    assert len(grid) == lq and all(len(r) == lk for r in grid)
    mask = allowed_mask(lq, lk, causal=opts["causal"] == "True", window=int(opts["window"]) if "window" in opts
                        else None, block_size=int(opts["block_size"]) if "block_size" in opts else None)
    assert mask.tolist() == grid
