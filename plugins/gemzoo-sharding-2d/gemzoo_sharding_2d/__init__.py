"""gemzoo-sharding-2d: 2D embedding sharding (tables sharded within groups of G ranks; the R = world / G groups
replicate each other or split each group shard R ways) and ``gemzoo plan``, its memory and traffic at scale."""

from gemzoo_sharding_2d.layout import Block, Layout, plan_layout
from gemzoo_sharding_2d.plugin import Sharding2D, Sharding2DOptions

__all__ = ["Block", "Layout", "Sharding2D", "Sharding2DOptions", "plan_layout"]
__version__ = "0.1.0"
