"""The sparse-side engine: pooled embedding bags over keyed jagged features.

With torchrec importable, :class:`SparseArch` holds a ``torchrec.EmbeddingBagCollection`` (so torchrec's
planner and DistributedModelParallel can shard it) and feeds it a ``KeyedJaggedTensor``. Without
torchrec (the GPU image has none), or with ``GEMZOO_NO_TORCHREC=1``, it holds one ``nn.EmbeddingBag``
per table with the same parameter names and says so once. The trainer switches its tables to sparse
gradients (only the rows a batch looked up), which its Adagrad applies as a sparse update.

Inputs follow torchrec's KeyedJaggedTensor layout: ``keys`` (feature names), ``values [N]`` int64 ids
and ``lengths [F * B]`` int64, key-major (all samples of key 0, then key 1, ...).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from gemzoo.errors import ConfigError, JaggedShapeError

log = logging.getLogger("gemzoo.embedding")

NO_TORCHREC_ENV = "GEMZOO_NO_TORCHREC"


@dataclass(frozen=True)
class TableConfig:
    """One pooled table; the same field names as ``torchrec.EmbeddingBagConfig``."""

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: list[str] = field(default_factory=list)
    pooling: str = "sum"  # "sum" or "mean"

    def to_torchrec(self):
        from torchrec import EmbeddingBagConfig, PoolingType

        return EmbeddingBagConfig(
            name=self.name, num_embeddings=self.num_embeddings, embedding_dim=self.embedding_dim,
            feature_names=list(self.feature_names), pooling=PoolingType[self.pooling.upper()],
        )


@functools.cache
def _torchrec_import_error() -> str | None:
    try:
        with torch.device("cpu"):  # torchrec makes tensors at import; a surrounding meta context breaks that
            import torchrec  # noqa: F401
            from torchrec import EmbeddingBagCollection, KeyedJaggedTensor  # noqa: F401
    except Exception as exc:  # ImportError, or a broken fbgemm build raising at import
        first_line = (str(exc).strip().splitlines() or [""])[0]
        return f"{type(exc).__name__}: {first_line}"
    return None


_notice_given = False


def torchrec_available() -> bool:
    """True when torchrec imports and ``GEMZOO_NO_TORCHREC`` is not set."""
    if os.environ.get(NO_TORCHREC_ENV, "") not in ("", "0"):
        return False
    return _torchrec_import_error() is None


def _notice_fallback() -> None:
    global _notice_given
    if _notice_given:
        return
    _notice_given = True
    if os.environ.get(NO_TORCHREC_ENV, "") not in ("", "0"):
        why = f"{NO_TORCHREC_ENV} is set"
    else:
        why = f"torchrec is unavailable ({_torchrec_import_error()})"
    log.warning("gemzoo: %s; using the plain-torch EmbeddingBag engine for sparse features", why)


def check_sparse_input(keys, values: torch.Tensor, lengths: torch.Tensor, batch_size: int) -> None:
    if values.dtype not in (torch.int64, torch.int32) or lengths.dtype not in (torch.int64, torch.int32):
        raise JaggedShapeError(
            f"sparse values and lengths must be integer tensors, got {values.dtype} and {lengths.dtype}"
        )
    if lengths.numel() != len(keys) * batch_size:
        raise JaggedShapeError(
            f"sparse lengths must have len(keys) * batch = {len(keys)} * {batch_size} entries "
            f"(key-major, as KeyedJaggedTensor), got {lengths.numel()}"
        )


def key_totals(host_lengths: torch.Tensor | None, n_keys: int, batch: int, lengths: torch.Tensor) -> list[int] | None:
    """Ids per key (KeyedJaggedTensor's ``length_per_key``) from the host copy of ``lengths``, or None when
    there is none to read without a device sync."""
    if host_lengths is None or host_lengths.device.type != "cpu" or lengths.device.type == "cpu":
        return None
    if host_lengths.shape != lengths.shape:
        raise JaggedShapeError(f"host_lengths has shape {tuple(host_lengths.shape)} but lengths has "
                               f"{tuple(lengths.shape)}; pass the host copy of the same lengths")
    return host_lengths.long().view(n_keys, batch).sum(1).tolist()


class SparseArch(nn.Module):
    """Pooled lookups for every table; ``forward`` returns ``[B, sum(embedding_dim)]`` in table order.

    ``engine`` is ``"torchrec"`` or ``"torch"``. Parameters are named ``ebc.embedding_bags.<table>.weight``
    with either engine, so checkpoints move between them.
    """

    def __init__(self, tables: list[TableConfig], *, engine: str | None = None, device=None):
        super().__init__()
        if not tables:
            raise ConfigError("SparseArch needs at least one table; set the dataset's sparse table count > 0")
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ConfigError(f"sparse table names must be unique, got {names}")
        self.tables = list(tables)
        self.feature_names = [f for t in tables for f in t.feature_names]
        if engine is None:
            engine = "torchrec" if torchrec_available() else "torch"
        if engine == "torchrec":
            from torchrec import EmbeddingBagCollection

            # torchrec defaults to cpu when device is None; honour a surrounding `with torch.device(...)`
            device = torch.get_default_device() if device is None else device
            self.ebc = EmbeddingBagCollection(tables=[t.to_torchrec() for t in tables], device=device)
        elif engine == "torch":
            _notice_fallback()
            self.ebc = TorchEmbeddingBagCollection(tables, device=device)
        else:
            raise ConfigError(f"unknown embedding engine {engine!r}; use 'torchrec' or 'torch'")
        self.engine = engine

    def init_weights(self) -> None:
        for t in self.tables:
            w = self.ebc.embedding_bags[t.name].weight
            bound = t.num_embeddings ** -0.5
            with torch.no_grad():
                w.uniform_(-bound, bound)

    def forward(self, keys, values: torch.Tensor, lengths: torch.Tensor,
                host_lengths: torch.Tensor | None = None) -> torch.Tensor:
        """``host_lengths``: the same lengths on the host (``gemzoo.data.batch.host_view``), from which the ids
        of each feature are counted without waiting for the device."""
        keys = list(keys)
        if keys != self.feature_names:
            raise JaggedShapeError(f"sparse keys {keys} do not match the model's features {self.feature_names}")
        batch = lengths.numel() // max(len(keys), 1)
        check_sparse_input(keys, values, lengths, batch)
        values, lengths = values.long().contiguous(), lengths.long().contiguous()  # fbgemm needs contiguous
        totals = key_totals(host_lengths, len(keys), batch, lengths)
        if self.engine == "torchrec":
            from torchrec import KeyedJaggedTensor

            kjt = KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, length_per_key=totals)
            pooled = self.ebc(kjt)
            pooled = pooled.wait() if hasattr(pooled, "wait") else pooled
            if list(pooled.keys()) == keys:
                return pooled.values()
            by_key = pooled.to_dict()  # sharded EBCs may return features grouped by rank
            return torch.cat([by_key[k] for k in keys], dim=1)
        if isinstance(self.ebc, TorchEmbeddingBagCollection):
            return self.ebc(keys, values, lengths, totals)
        return self.ebc(keys, values, lengths)  # a planner's sharded tables in its place


class TorchEmbeddingBagCollection(nn.Module):
    """Plain-torch stand-in for torchrec's EmbeddingBagCollection (same parameter names).

    ``sparse_grad``: table gradients hold only the looked-up rows, so backward and the optimizer touch
    those rows rather than whole tables (at gem-bench scale, 8 GB of dense gradients a step). Off by
    default, since not every optimizer takes sparse gradients; see use_sparse_gradients."""

    def __init__(self, tables: list[TableConfig], device=None, sparse_grad: bool = False):
        super().__init__()
        self.tables = list(tables)
        self.sparse_grad = sparse_grad
        self.embedding_bags = nn.ModuleDict({
            t.name: nn.EmbeddingBag(t.num_embeddings, t.embedding_dim, mode=t.pooling, device=device)
            for t in tables
        })
        self._feature_table = {f: t.name for t in tables for f in t.feature_names}

    # Never traced: its per-feature split is a host sync (a graph break anyway), and Inductor cannot take the
    # sparse table gradients on CUDA ("Cannot access storage of SparseTensorImpl", H200 with run.compile).
    @torch.compiler.disable
    def forward(self, keys, values: torch.Tensor, lengths: torch.Tensor, totals: list[int] | None = None
                ) -> torch.Tensor:
        """``totals``: the number of ids of each key, if known on the host (else read from ``lengths``)."""
        batch = lengths.numel() // len(keys)
        per_key = lengths.view(len(keys), batch)
        if totals is None:
            totals = per_key.sum(1).tolist()
        starts = [0]
        for n in totals:
            starts.append(starts[-1] + n)
        outs = []
        for i, key in enumerate(keys):
            bag = self.embedding_bags[self._feature_table[key]]
            ids = values[starts[i]:starts[i + 1]]
            offsets = torch.zeros(batch + 1, dtype=torch.int64, device=values.device)
            torch.cumsum(per_key[i], 0, out=offsets[1:])
            if ids.device.type == "cpu" and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= bag.num_embeddings):
                raise JaggedShapeError(
                    f"feature {key!r} has ids outside [0, {bag.num_embeddings}) for table "
                    f"{self._feature_table[key]!r}"
                )
            outs.append(F.embedding_bag(ids, bag.weight, offsets, mode=bag.mode, include_last_offset=True,
                                        sparse=self.sparse_grad))
        return torch.cat(outs, dim=1)


def use_sparse_gradients(model: nn.Module) -> int:
    """Give every plain-torch table collection in ``model`` sparse gradients; returns how many it set.
    For the owner of the optimizer to call: torch's Adagrad and SGD take sparse gradients, AdamW does not."""
    collections = [m for m in model.modules() if isinstance(m, TorchEmbeddingBagCollection)]
    for m in collections:
        m.sparse_grad = True
    return len(collections)

