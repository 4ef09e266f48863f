"""The relative bias cases shared by the interpreter script (``gdpa_rb_interp_cases.py``, CPU tensors) and the
GPU tests: random jagged inputs with HSTU-like timestamps, the kernel family's launches into NaN-poisoned
outputs and gradients, and the errors of out, dq, dk, dv and both tables' gradients against the fp64 reference.
Importing it does not import Triton."""

from __future__ import annotations

import torch

from gemzoo.api import ACTIVATION_CODES, RelativeAttentionBias, lengths_to_offsets, reference_attention


def rel_err(a, b) -> float:
    """Relative error of ``a`` against ``b`` (max abs error where ``b`` is all zero)."""
    a, b = a.double().cpu(), b.double().cpu()
    if b.norm() == 0:
        return float((a - b).abs().max()) if a.numel() else 0.0
    return float((a - b).norm() / b.norm())


def timestamps(gen, n: int) -> torch.Tensor:
    """[n] int64 seconds: a walk with gaps from 0 to about 1e5 s (log-uniform, some equal neighbours), so the
    time buckets of a sequence's pairs spread from 0 to past the last bucket."""
    gaps = torch.exp(torch.rand(n, generator=gen) * 11.5).long()
    gaps[torch.rand(n, generator=gen) < 0.15] = 0
    return 1_700_000_000 + gaps.cumsum(0)


def make_inputs(gen, q_lens, k_lens, heads, d, dv, dtype, n_pos, n_buckets, timed, device="cpu"):
    """q, k, v, dO, offsets and a RelativeAttentionBias (fp32 tables) on ``device``."""
    q_lens = torch.tensor(q_lens)
    k_lens = q_lens if k_lens is None else torch.tensor(k_lens)
    q_off, k_off = lengths_to_offsets(q_lens).to(device), lengths_to_offsets(k_lens).to(device)
    tq, tk = int(q_lens.sum()), int(k_lens.sum())
    q, k = torch.randn(tq, heads, d, generator=gen), torch.randn(tk, heads, d, generator=gen)
    v, grad = torch.randn(tk, heads, dv, generator=gen), torch.randn(tq, heads, dv, generator=gen)
    positions = torch.randn(n_pos, generator=gen)
    tw = q_times = k_times = None
    if timed:
        tw = torch.randn(n_buckets + 1, generator=gen)
        k_times = timestamps(gen, tk)
        q_times = timestamps(gen, tq)
        if tq == tk and tq:  # self attention: half the queries share a key's time (gap 0: bucket 0)
            q_times[::2] = k_times[::2]
        tw, q_times, k_times = tw.to(device), q_times.to(device), k_times.to(device)
    rb = RelativeAttentionBias(positions.to(device), tw, q_times, k_times)
    q, k, v, grad = (t.to(device, dtype) for t in (q, k, v, grad))
    return q, k, v, grad, q_off, k_off, rb


def run_family(q, k, v, grad, q_off, k_off, rb, act, causal, window, scale, norm, options):
    """The family's launches with the bias, into NaN-filled buffers: out, dq, dk, dv, d positions, d tw."""
    from gemzoo_jfa.family import launch_bwd, launch_fwd, relative_bias_args

    rel = relative_bias_args(rb.positions, rb.time_weights, rb.q_times, rb.k_times, rb.bucket_divisor)
    code, inv_norm, win = ACTIVATION_CODES[act], 1.0 if norm is None else 1.0 / norm, -1 if window is None else window
    out = torch.full((q.shape[0], q.shape[1], v.shape[2]), float("nan"), device=q.device, dtype=q.dtype)
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), device=q.device) if code == 0 else None
    launch_fwd(q, k, v, q_off, k_off, causal, scale, win, out, lse, code, inv_norm, options=options, rel=rel)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    d_pos, d_tw = launch_bwd(grad, q, k, v, out, lse, q_off, k_off, causal, scale, win, dq, dk, dv, code, inv_norm,
                             options=options, rel=rel)
    return out, dq, dk, dv, d_pos, d_tw


def reference(q, k, v, grad, q_off, k_off, rb, act, causal, window, scale, norm):
    """fp64 reference: out, dq, dk, dv, d positions, d time_weights (None without time weights)."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    pos = rb.positions.detach().double().requires_grad_()
    tw = None if rb.time_weights is None else rb.time_weights.detach().double().requires_grad_()
    rb64 = RelativeAttentionBias(pos, tw, rb.q_times, rb.k_times, rb.bucket_divisor)
    out = reference_attention(*leaves, q_off, k_off, causal=causal, window=window, activation=act, scale=scale,
                              norm=norm, relative_bias=rb64)
    if out.requires_grad:
        out.backward(grad.double())
    grads = [torch.zeros_like(t) if t.grad is None else t.grad for t in leaves + [pos]]
    return (out.detach(), *grads, None if tw is None else (torch.zeros_like(tw) if tw.grad is None else tw.grad))


def errors(got, want) -> dict:
    """{name: relative error, name_finite: bool} for out, dq, dk, dv, dpos, dtw."""
    res = {}
    for name, mine, theirs in zip(("out", "dq", "dk", "dv", "dpos", "dtw"), got, want, strict=True):
        if theirs is None:
            res[name + "_none"] = mine is None
            continue
        res[name] = rel_err(mine, theirs)
        res[name + "_finite"] = bool(torch.isfinite(mine).all())
    return res
