"""Built-in model families: ``gem``, ``hstu``, ``sasrec``."""

from __future__ import annotations

from gemzoo.models import gem, hstu, sasrec
from gemzoo.plugins import hookimpl


@hookimpl
def gemzoo_register_models(register):
    register("gem", gem.SPEC)
    register("hstu", hstu.SPEC)
    register("sasrec", sasrec.SPEC)
