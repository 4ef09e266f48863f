"""Model families, one folder each. Every model calls attention through :class:`JaggedAttention`."""
