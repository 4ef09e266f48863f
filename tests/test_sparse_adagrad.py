"""SparseAdagrad: torch's Adagrad arithmetic on sparse table gradients, with no op whose size needs the data."""

import pytest
import torch
import torch.nn.functional as F

from gemzoo.train.sparse_adagrad import SparseAdagrad, sync_free_update, sync_free_update_many

CUDA = torch.cuda.is_available()


def table_grads(seed: int, rows: int = 50, dim: int = 8, lookups: int = 40, steps: int = 3):
    """Sparse gradients of an embedding bag with repeated ids (uncoalesced, as backward gives them)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, rows // 3, (lookups,), generator=g)  # a third of the rows: many repeats
        out.append(torch.sparse_coo_tensor(ids[None], torch.randn(lookups, dim, generator=g), (rows, dim)))
    return out


def run(opt_cls, grads, init, device="cpu", **kwargs):
    p = torch.nn.Parameter(init.clone().to(device))
    opt = opt_cls([p], **kwargs)
    for grad in grads:
        p.grad = grad.to(device)
        opt.step()
    return p.detach().cpu(), opt


@pytest.mark.parametrize("options", [{}, {"lr_decay": 0.1}, {"maximize": True}, {"initial_accumulator_value": 0.5},
                                     {"eps": 0.0}], ids=str)
def test_sync_free_step_matches_torch_adagrad(options):
    grads, init = table_grads(0), torch.randn(50, 8)
    want, ref = run(torch.optim.Adagrad, grads, init, lr=0.1, **options)
    got, opt = run(SparseAdagrad, grads, init, lr=0.1, sync_free=True, **options)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(opt.state_dict()["state"][0]["sum"], ref.state_dict()["state"][0]["sum"],
                               rtol=1e-6, atol=1e-7)
    assert torch.isfinite(got).all()  # eps = 0: the unused slots' 0 / 0 adds nothing


def test_without_repeated_ids_the_step_is_bit_exact_with_torch():
    g = torch.Generator().manual_seed(1)
    grads = [torch.sparse_coo_tensor(torch.randperm(50, generator=g)[:20][None], torch.randn(20, 8, generator=g),
                                     (50, 8)) for _ in range(3)]
    init = torch.randn(50, 8)
    want, _ = run(torch.optim.Adagrad, grads, init, lr=0.1)
    got, _ = run(SparseAdagrad, grads, init, lr=0.1, sync_free=True)
    assert torch.equal(got, want)


def test_on_the_cpu_the_default_is_torchs_step_bit_for_bit():
    grads, init = table_grads(2), torch.randn(50, 8)
    want, _ = run(torch.optim.Adagrad, grads, init, lr=0.1)
    got, opt = run(SparseAdagrad, grads, init, lr=0.1)
    assert opt.sync_free is None and torch.equal(got, want)


def test_the_update_has_no_data_dependent_op():
    """On the meta device every op must size its output from shapes alone; a coalesce, nonzero or item() would
    raise here. That is the proof the CUDA step never waits for the host."""
    p, s = torch.empty(50, 8, device="meta"), torch.empty(50, 8, device="meta")
    sync_free_update(p, s, torch.empty(40, dtype=torch.long, device="meta"), torch.empty(40, 8, device="meta"),
                     clr=0.1, eps=1e-10)
    ids = torch.empty(40, dtype=torch.long, device="meta")
    for data_dependent in (lambda: torch.unique(ids), lambda: ids.nonzero(), lambda: ids.max().item()):
        with pytest.raises((NotImplementedError, RuntimeError)):  # the control: such ops do raise on meta
            data_dependent()


def _tables(seed: int):
    """Tables as a step gives them: different sizes, repeated ids, one looked up not at all, one wider."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(50, 8, 40), (7, 8, 30), (120, 8, 5), (30, 8, 0), (40, 16, 25)]  # rows, width, lookups
    out = []
    for rows, dim, n in shapes:
        ids = torch.randint(0, max(rows // 3, 1), (n,), generator=g)
        out.append((torch.randn(rows, dim, generator=g), torch.rand(rows, dim, generator=g), ids,
                    torch.randn(n, dim, generator=g), 0.05 + 0.01 * len(out)))
    return out


def test_many_tables_in_one_batch_equal_each_table_alone_bit_for_bit():
    """The batched update (one sort of every table's lookups, one segment sum) gives each table exactly what
    its own update gives, on the CPU, where the additions run in the same order."""
    for seed in range(3):
        tables = _tables(seed)
        alone = [(p.clone(), s.clone()) for p, s, *_ in tables]
        for (p, s), (_, _, ids, vals, clr) in zip(alone, tables, strict=True):
            sync_free_update(p, s, ids, vals, clr=clr, eps=1e-10)
        together = [(p.clone(), s.clone(), ids, vals, clr) for p, s, ids, vals, clr in tables]
        sync_free_update_many(together, eps=1e-10)
        for (p1, s1), (p2, s2, *_) in zip(alone, together, strict=True):
            assert torch.equal(p1, p2) and torch.equal(s1, s2)


def test_several_tables_train_like_torch_adagrad():
    params = [torch.randn(50, 8), torch.randn(9, 8), torch.randn(64, 4)]
    grads = [table_grads(10 + i, rows=p.shape[0], dim=p.shape[1]) for i, p in enumerate(params)]
    results = []
    for cls, kw in ((torch.optim.Adagrad, {}), (SparseAdagrad, {"sync_free": True})):
        ps = [torch.nn.Parameter(p.clone()) for p in params]
        opt = cls(ps, lr=0.1, **kw)
        for step in range(3):
            for p, g in zip(ps, grads, strict=True):
                p.grad = g[step]
            opt.step()
        results.append([p.detach() for p in ps])
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_the_batched_update_has_no_data_dependent_op():
    tables = [(torch.empty(r, 8, device="meta"), torch.empty(r, 8, device="meta"),
               torch.empty(n, dtype=torch.long, device="meta"), torch.empty(n, 8, device="meta"), 0.1)
              for r, n in ((50, 40), (7, 3), (100, 0))]
    sync_free_update_many(tables, eps=1e-10)


def test_dense_gradients_and_empty_lookups_take_their_usual_path():
    dense = torch.nn.Parameter(torch.randn(4, 3))
    table = torch.nn.Parameter(torch.randn(50, 8))
    ref_dense, ref_table = dense.detach().clone(), table.detach().clone()
    opt = SparseAdagrad([dense, table], lr=0.1, sync_free=True)
    dense.grad = torch.ones(4, 3)
    table.grad = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long), torch.zeros(0, 8), (50, 8))
    opt.step()
    assert torch.equal(table.detach(), ref_table)  # no rows looked up: nothing moves
    ref = torch.optim.Adagrad([torch.nn.Parameter(ref_dense)], lr=0.1)
    ref.param_groups[0]["params"][0].grad = torch.ones(4, 3)
    ref.step()
    assert torch.equal(dense.detach(), ref.param_groups[0]["params"][0].detach())
    assert dense.grad is not None and table.grad is not None  # the hidden gradients are put back
    assert float(opt.state[table]["step"]) == 1.0 and float(opt.state[dense]["step"]) == 1.0


def test_weight_decay_with_sparse_gradients_is_refused_like_torch():
    table = torch.nn.Parameter(torch.randn(50, 8))
    table.grad = table_grads(3, steps=1)[0]
    with pytest.raises(RuntimeError, match="weight_decay"):
        SparseAdagrad([table], lr=0.1, weight_decay=0.1, sync_free=True).step()


def test_state_dict_moves_between_torch_adagrad_and_this_class():
    grads, init = table_grads(4, steps=4), torch.randn(50, 8)
    want, _ = run(torch.optim.Adagrad, grads, init, lr=0.1)
    p = torch.nn.Parameter(init.clone())
    first = torch.optim.Adagrad([p], lr=0.1)
    for grad in grads[:2]:
        p.grad = grad
        first.step()
    second = SparseAdagrad([p], lr=0.1, sync_free=True)
    second.load_state_dict(first.state_dict())
    for grad in grads[2:]:
        p.grad = grad
        second.step()
    torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=1e-7)


def test_embedding_bag_gradients_train_like_torch_adagrad():
    """The trainer's case: F.embedding_bag(sparse=True) backward, a table shared by two features."""
    ids = torch.tensor([3, 7, 3, 3, 9, 7, 1])
    offsets = torch.tensor([0, 3, 5, 7])
    results = []
    for cls, kw in ((torch.optim.Adagrad, {}), (SparseAdagrad, {"sync_free": True})):
        w = torch.nn.Parameter(torch.linspace(-1, 1, 12 * 4).reshape(12, 4))
        opt = cls([w], lr=0.05, **kw)
        for _ in range(3):
            a = F.embedding_bag(ids, w, offsets, mode="sum", include_last_offset=True, sparse=True)
            b = F.embedding_bag(ids.flip(0), w, offsets, mode="sum", include_last_offset=True, sparse=True)
            ((a * b).sum() + a.square().sum()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        results.append(w.detach())
    torch.testing.assert_close(results[1], results[0], rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_batched_tables_never_sync_and_match_each_table_alone():
    tables = [tuple(t.cuda() if isinstance(t, torch.Tensor) else t for t in u) for u in _tables(7)]
    alone = [(p.clone(), s.clone()) for p, s, *_ in tables]
    for (p, s), (_, _, ids, vals, clr) in zip(alone, tables, strict=True):
        sync_free_update(p, s, ids, vals, clr=clr, eps=1e-10)
    together = [(p.clone(), s.clone(), ids, vals, clr) for p, s, ids, vals, clr in tables]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sync_free_update_many(together, eps=1e-10)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for (p1, s1), (p2, s2, *_) in zip(alone, together, strict=True):  # atomics: the duplicate rows' sums may round apart
        torch.testing.assert_close(p2, p1, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(s2, s1, rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_step_never_syncs_and_matches_torch():
    grads, init = table_grads(5), torch.randn(50, 8)
    want, _ = run(torch.optim.Adagrad, grads, init, device="cuda", lr=0.1)
    p = torch.nn.Parameter(init.clone().cuda())
    opt = SparseAdagrad([p], lr=0.1)
    device_grads = [g.cuda() for g in grads]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for grad in device_grads:
            p.grad = grad
            opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(p.detach().cpu(), want, rtol=1e-6, atol=1e-7)
