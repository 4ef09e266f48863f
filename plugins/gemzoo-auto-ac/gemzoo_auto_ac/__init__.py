"""gemzoo-auto-ac: the PT2 partitioner chooses what to recompute under an activation-memory budget."""

from gemzoo_auto_ac.plugin import AutoACOptions, AutoACPolicy, BudgetSearch

__all__ = ["AutoACOptions", "AutoACPolicy", "BudgetSearch"]
__version__ = "0.1.0"
