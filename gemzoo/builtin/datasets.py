"""Built-in datasets: ``synthetic-gem`` (seeded, planted labels) and ``movielens`` (user ratings.dat)."""

from __future__ import annotations

from gemzoo.data import movielens, synthetic
from gemzoo.plugins import hookimpl


@hookimpl
def gemzoo_register_datasets(register):
    register("synthetic-gem", synthetic.SPEC)
    register("movielens", movielens.SPEC)
