"""gemzoo-batch-shuffle: balance the jagged work of a global batch across data-parallel ranks."""

from gemzoo_batch_shuffle.partition import imbalance, partition
from gemzoo_batch_shuffle.plugin import BatchShuffle, BatchShuffleOptions

__all__ = ["BatchShuffle", "BatchShuffleOptions", "imbalance", "partition"]
__version__ = "0.1.0"
