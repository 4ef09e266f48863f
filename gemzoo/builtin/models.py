"""Built-in model families: ``gem``, ``hstu``, ``sasrec``."""

from __future__ import annotations

from gemzoo.plugins import hookimpl


@hookimpl
def gemzoo_register_models(register):
    from gemzoo.models import gem, hstu, sasrec

    register("gem", gem.SPEC)
    register("hstu", hstu.SPEC)
    register("sasrec", sasrec.SPEC)
