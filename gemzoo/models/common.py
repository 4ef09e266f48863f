"""Pieces shared by model families: transformer blocks, init and metrics. The attention call site
(``JaggedAttention``, ``attention_sites``) is :mod:`gemzoo.attention`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemzoo.attention import JaggedAttention
from gemzoo.errors import ConfigError
from gemzoo.flops import attention_flops, attention_pairs, linear_flops, sample_pairs
from gemzoo.interfaces.attention import AttentionRequest
from gemzoo.jagged import positions, seq_ids

# ---------------------------------------------------------------------------------------------
# Shared building blocks. Every linear is a plain nn.Linear with a stable name (precision policies
# swap them by name), and every linear output is cast back to the residual dtype, so a bf16-compute
# linear (the bf16 policy) works anywhere.
# ---------------------------------------------------------------------------------------------



def reverse_positions(offsets: torch.Tensor, total: int, max_len: int) -> torch.Tensor:
    """Distance of each row from the end of its sequence (0 = most recent), clamped to max_len - 1."""
    ids = seq_ids(offsets, total)
    lengths = offsets[1:] - offsets[:-1]
    return (lengths[ids] - 1 - positions(offsets, total)).clamp(max=max_len - 1)


def self_attention_options(cfg, head_dim: int, family: str) -> dict:
    """Options of a model's self-attention sites from ``[model] attention_block_size``, ``attention_window``
    and ``rope_theta`` (0: off), checked when the model is built."""
    opts = {}
    for key, opt in (("attention_block_size", "block_size"), ("attention_window", "window")):
        value = getattr(cfg, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"[model] ({family}): {key} must be an int >= 0 (0: off), got {value!r}")
        if value:
            opts[opt] = value
    theta = cfg.rope_theta
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 <= theta < float("inf"):
        raise ConfigError(f"[model] ({family}): rope_theta must be a number >= 0 (0: off, e.g. 10000.0), got {theta!r}")
    if theta:
        if head_dim % 2:
            raise ConfigError(f"[model] ({family}): rope_theta needs an even head dim, got {head_dim}; "
                              "change the head dim or set rope_theta = 0")
        opts["rope_theta"] = float(theta)
    return opts


def self_attention_pairs(lengths: torch.Tensor, *, causal: bool, block_size: int | None = None,
                         window: int | None = None) -> int:
    """Allowed (query, key) pairs of self-attention over sequences of ``lengths``: L(L+1)/2 causal, L^2 not;
    with ``block_size`` / ``window``, exactly the pairs the mask rule allows."""
    if block_size is not None or window is not None:
        return attention_pairs(lengths, causal=causal, window=window, block_size=block_size)
    lengths = lengths.long().cpu()
    return int((lengths * (lengths + 1) // 2).sum()) if causal else int((lengths * lengths).sum())


def check_heads(d_model: int, num_heads: int, head_dim: int | None, where: str) -> int:
    if num_heads < 1:
        raise ConfigError(f"[model] num_heads must be >= 1, got {num_heads}")
    if head_dim is None:
        if d_model % num_heads:
            raise ConfigError(
                f"[model] d_model={d_model} is not divisible by num_heads={num_heads} ({where}); "
                "change one of them or set head_dim"
            )
        return d_model // num_heads
    if head_dim < 1:
        raise ConfigError(f"[model] head_dim must be >= 1, got {head_dim}")
    return head_dim


def check_kv_heads(num_heads: int, num_kv_heads: int, family: str) -> int:
    """The k/v head count of ``[model] num_kv_heads`` (0: ``num_heads``, multi-head attention; a divisor of
    ``num_heads``: grouped-query attention, 1 multi-query), checked when the model is built."""
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int) or num_kv_heads < 0:
        raise ConfigError(f"[model] ({family}): num_kv_heads must be an int >= 0 (0: num_heads), got {num_kv_heads!r}")
    kv = num_kv_heads or num_heads
    if kv > num_heads or num_heads % kv:
        divisors = ", ".join(str(d) for d in range(1, num_heads + 1) if num_heads % d == 0)
        raise ConfigError(f"[model] ({family}): num_kv_heads={num_kv_heads} does not divide num_heads={num_heads}; "
                          f"grouped-query attention needs one of {divisors} (or 0: num_heads)")
    return kv


class SelfAttention(nn.Module):
    """Fused qkv projection, jagged attention, output projection: ``qkv``, ``attn``, ``out``. With
    ``num_kv_heads`` < ``num_heads`` (grouped-query attention) k and v have ``num_kv_heads`` heads: ``qkv`` is
    [q | k | v] of num_heads, num_kv_heads and num_kv_heads heads."""

    def __init__(self, d_model: int, num_heads: int, head_dim: int, request: AttentionRequest,
                 num_kv_heads: int | None = None, **options):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        inner = num_heads * head_dim
        self.qkv = nn.Linear(d_model, (num_heads + 2 * self.num_kv_heads) * head_dim)
        self.attn = JaggedAttention(request.replace(head_dim=head_dim, grouped_kv=self.num_kv_heads != num_heads),
                                    **options)
        self.out = nn.Linear(inner, d_model)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, max_len: int | None = None) -> torch.Tensor:
        # the head count comes from qkv's output: under tensor parallelism (run.mesh tp) this rank's heads
        t, qkv = x.shape[0], self.qkv(x)
        if self.num_kv_heads == self.num_heads:
            heads = qkv.shape[1] // (3 * self.head_dim)
            q, k, v = qkv.view(t, 3, heads, self.head_dim).unbind(1)
        else:  # this rank's kv heads: its share of the width, in the ratio num_heads : num_kv_heads : num_kv_heads
            kv_heads = qkv.shape[1] // self.head_dim * self.num_kv_heads // (self.num_heads + 2 * self.num_kv_heads)
            heads = kv_heads * (self.num_heads // self.num_kv_heads)
            q, k, v = qkv.split([heads * self.head_dim, kv_heads * self.head_dim, kv_heads * self.head_dim], dim=1)
            q, k, v = (z.view(t, -1, self.head_dim) for z in (q, k, v))
        o = self.attn(q, k, v, offsets, max_q_len=max_len, max_k_len=max_len)
        return self.out(o.reshape(t, heads * self.head_dim)).to(x.dtype)

    def tp_style(self) -> str:
        """The qkv projection's tensor-parallel style: 3 equal parts, or q | k | v of their own sizes (GQA)."""
        if self.num_kv_heads == self.num_heads:
            return "colwise:3"
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return f"colwise:{q},{kv},{kv}"

    def flops(self, lengths: torch.Tensor) -> int:
        tokens = int(lengths.sum())
        inner = self.num_heads * self.head_dim
        pairs = self_attention_pairs(lengths, causal=self.attn.request.causal, **self.attn.mask_options())
        return (linear_flops(tokens, self.qkv.in_features, self.qkv.out_features)
                + linear_flops(tokens, inner, self.out.out_features) + attention_flops(pairs, self.num_heads, self.head_dim))

    def sample_flops(self, lengths: torch.Tensor) -> torch.Tensor:
        """int64 [B]: each sequence's share of ``flops(lengths)``."""
        lengths, inner = lengths.long().cpu(), self.num_heads * self.head_dim
        pairs = sample_pairs(lengths, causal=self.attn.request.causal, **self.attn.mask_options())
        return (linear_flops(lengths, self.qkv.in_features, self.qkv.out_features)
                + linear_flops(lengths, inner, self.out.out_features)
                + attention_flops(pairs, self.num_heads, self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, d_model: int, hidden: int, activation: str = "gelu", dropout: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden)
        self.fc2 = nn.Linear(hidden, d_model)
        self.act = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu}[activation]
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1(x).to(x.dtype))
        return self.fc2(self.dropout(h)).to(x.dtype)

    def flops(self, tokens: int) -> int:
        return linear_flops(tokens, self.fc1.in_features, self.fc1.out_features) + linear_flops(
            tokens, self.fc2.in_features, self.fc2.out_features)


class TransformerBlock(nn.Module):
    """Pre-norm block over a jagged batch: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    is_transformer_block = True

    def __init__(self, d_model: int, num_heads: int, head_dim: int, ffn_hidden: int, *, request: AttentionRequest,
                 dropout: float = 0.0, activation: str = "gelu", num_kv_heads: int | None = None):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, num_heads, head_dim, request, num_kv_heads)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = FeedForward(d_model, ffn_hidden, activation, dropout)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, max_len: int | None = None) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.norm1(x), offsets, max_len))
        return x + self.dropout(self.mlp(self.norm2(x)))

    def tp_plan(self) -> dict[str, str]:
        """Tensor parallelism (``run.mesh`` tp): Megatron-style, each rank keeps its share of the heads and of
        the MLP's hidden units; ``colwise:3``: a fused projection of 3 parts (q, k, v), each split by heads (with
        grouped k/v the parts' sizes: q's heads, then k's and v's)."""
        return {"attn.qkv": self.attn.tp_style(), "attn.out": "rowwise", "mlp.fc1": "colwise", "mlp.fc2": "rowwise"}

    def flops(self, lengths: torch.Tensor) -> int:
        return self.attn.flops(lengths) + self.mlp.flops(int(lengths.sum()))

    def sample_flops(self, lengths: torch.Tensor) -> torch.Tensor:
        """int64 [B]: each sequence's share of ``flops(lengths)`` (linear FLOPs are elementwise in tokens)."""
        return self.attn.sample_flops(lengths) + self.mlp.flops(lengths.long().cpu())


class MLP(nn.Module):
    """Linear + activation stack: ``layers.0``, ``layers.1``... (the last layer has an activation too)."""

    def __init__(self, dims: list[int], activation: str = "relu", dropout: float = 0.0):
        super().__init__()
        if len(dims) < 2:
            raise ConfigError(f"an MLP needs at least input and output sizes, got {dims}")
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:], strict=True))
        self.act = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu}[activation]
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        for layer in self.layers:
            x = self.dropout(self.act(layer(x).to(dtype)))
        return x

    def flops(self, tokens: int) -> int:
        return sum(linear_flops(tokens, m.in_features, m.out_features) for m in self.layers)


def init_weights(module: nn.Module, *, std: float = 0.02, embedding_std: float | None = None,
                 skip: tuple[nn.Module, ...] = ()) -> None:
    """Deterministically (re)initialise every parameter and buffer of ``module`` from torch's global RNG.

    Linear: truncated normal(std; std <= 0 means 1/sqrt(fan_in)), zero bias. LayerNorm: ones / zeros. Embedding / EmbeddingBag:
    normal(embedding_std, default std). Modules listed in ``skip`` are initialised by their owner. Anything else with
    parameters raises, so a new module type cannot silently keep uninitialised (to_empty) memory.
    """
    done: set[int] = set()
    for m in skip:
        done.update(id(p) for p in m.parameters())
        done.update(id(b) for b in m.buffers())
    with torch.no_grad():
        for m in module.modules():
            if any(m is s for s in skip):
                continue
            if isinstance(m, nn.Linear):
                s = std if std > 0 else m.in_features ** -0.5
                nn.init.trunc_normal_(m.weight, std=s, a=-2 * s, b=2 * s)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, nn.LayerNorm):
                if m.weight is not None:
                    m.weight.fill_(1.0)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
                m.weight.normal_(0.0, std if embedding_std is None else embedding_std)
            else:
                continue
            done.update(id(p) for p in m.parameters(recurse=False))
    missing = [n for n, p in module.named_parameters() if id(p) not in done]
    missing += [n for n, b in module.named_buffers() if id(b) not in done]
    if missing:
        raise RuntimeError(f"init_weights does not know how to initialise: {', '.join(missing)}")


def binary_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC AUC from ranks (Mann-Whitney U), ties counted as one half. NaN if a class is absent."""
    scores = scores.detach().double().flatten().cpu()
    labels = labels.detach().flatten().cpu() > 0.5
    n_pos = int(labels.sum())
    n_neg = labels.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    uniq, inverse, counts = torch.unique(scores, return_inverse=True, return_counts=True)
    # average 1-based rank of each distinct score: (first rank + last rank) / 2
    last = torch.cumsum(counts, 0).double()
    avg_rank = last - (counts.double() - 1) / 2
    rank_sum = avg_rank[inverse][labels].sum().item()
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def log2_discount(rank: torch.Tensor) -> torch.Tensor:
    return 1.0 / torch.log2(rank.double() + 2.0)


__all__ = [
    "reverse_positions", "self_attention_pairs", "check_heads", "check_kv_heads", "SelfAttention", "FeedForward",
    "TransformerBlock", "MLP", "init_weights", "binary_auc", "log2_discount",
]


def require_data_info(family: str, data_info: dict, task: str, hint: str) -> None:
    """Fail at build, with the fix, when a model is paired with a dataset serving another task."""
    served = data_info.get("task", task)
    if served != task:
        raise ConfigError(f"model {family!r} does {task} but the dataset serves {served!r} batches; {hint}")
    for key in ("num_items", "max_len"):
        if key not in data_info:
            raise ConfigError(f"model {family!r} needs data info {key!r}; {hint}")
