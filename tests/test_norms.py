"""RMSNorm and fused add + RMSNorm: variants, no writes to inputs, bad input, compile."""

import pytest
import torch

from opcontract import ContractViolation, dispatch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["torch", "triton"]


def _rows(T=6, H=40, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).to(dtype).to(DEVICE) for s in ((T, H), (T, H), (H,))]


@pytest.mark.parametrize("backend", BACKENDS)
def test_variants_match_their_formulas(backend):
    x, _, w = _rows(dtype=torch.float32)
    norm = dispatch.op("rms_norm", backend=backend)
    xhat = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5)
    for variant, expect in (("plain", xhat * w), ("centred", xhat * (1 + w)), ("weightless", xhat)):
        y = norm(x, None if variant == "weightless" else w, variant=variant, eps=1e-5)
        torch.testing.assert_close(y, expect, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inputs_are_never_written(backend):
    # The Triton interpreter truncates float32 -> bfloat16 conversions (a GPU rounds to
    # nearest even), so the exact sum check runs in float32 there.
    interpreted = backend == "triton" and DEVICE == "cpu"
    x, r, w = _rows(dtype=torch.float32 if interpreted else torch.bfloat16)
    keep = [t.clone() for t in (x, r, w)]
    out = dispatch.op("fused_add_rms_norm", backend=backend)(x, r, w, variant="centred")
    dispatch.op("rms_norm", backend=backend)(x, w)
    for before, after in zip(keep, (x, r, w), strict=True):
        assert torch.equal(before, after)
    assert torch.equal(out.residual_out, (x.float() + r.float()).to(x.dtype))
    y = dispatch.op("rms_norm", backend=backend)(out.residual_out, w, variant="centred")
    assert torch.equal(out.y, y)


@pytest.mark.parametrize(
    "kw,match",
    [
        (
            {"variant": "weightless"},
            r"'weight'.*absent_when.*must be None when variant='weightless'",
        ),
        ({"eps": 0.0}, r"'eps'.*params\.eps\.check"),
        ({"eps": -1e-6}, r"'eps'.*params\.eps\.check"),
        ({"variant": "scaled"}, r"'variant'.*choices"),
    ],
)
def test_bad_params(kw, match):
    x, _, w = _rows()
    with pytest.raises(ContractViolation, match=match):
        dispatch.op("rms_norm")(x, w, **kw)


def test_bad_tensors():
    x, r, w = _rows()
    norm = dispatch.op("rms_norm")
    with pytest.raises(ContractViolation, match=r"'weight'.*shape\[0\].*H = 39 here but H = 40"):
        norm(x, w[:39])
    with pytest.raises(ContractViolation, match=r"'weight'.*missing"):
        norm(x, None)
    with pytest.raises(ContractViolation, match=r"'weight'.*dtype of 'x'"):
        norm(x, w.float())
    with pytest.raises(ContractViolation, match=r"'residual'.*device"):
        dispatch.op("fused_add_rms_norm")(x, r.to("meta"), w)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_norm_keeps_its_bits(backend):
    x, r, w = _rows(dtype=torch.float32)
    op = dispatch.op("fused_add_rms_norm", backend=backend)

    def step(x, r, w):
        out = op(x, r, w, variant="centred", eps=1e-5)
        return out.y, out.residual_out

    results = []
    for fn in (step, torch.compile(step, dynamic=False)):
        xs, rs, ws = (t.clone().requires_grad_() for t in (x, r, w))
        outs = fn(xs, rs, ws)
        torch.autograd.backward(outs, [torch.ones_like(outs[0]), torch.full_like(outs[1], 0.5)])
        results.append((*(o.detach() for o in outs), xs.grad, rs.grad, ws.grad))
    for eager, compiled in zip(*results, strict=True):
        assert torch.equal(eager, compiled)


@pytest.mark.parametrize("backend", BACKENDS)
def test_swiglu_packed_equals_separate(backend):
    g, u, _ = _rows(T=5, H=48)
    op = dispatch.op("swiglu", backend=backend)
    separate = op(g, u)
    packed = op(torch.cat([g, u], dim=-1), layout="packed")
    assert torch.equal(separate, packed)


def test_swiglu_bad_input():
    g, u, _ = _rows(T=5, H=48)
    op = dispatch.op("swiglu")
    with pytest.raises(ContractViolation, match=r"'gate'.*constraints\[0\].*must be even"):
        op(g[:, :47], layout="packed")
    with pytest.raises(ContractViolation, match=r"'up'.*must be None when layout='packed'"):
        op(g, u, layout="packed")
    with pytest.raises(ContractViolation, match=r"'up'.*missing"):
        op(g)
    with pytest.raises(ContractViolation, match=r"'up'.*G = 40 here but G = 48"):
        op(g, u[:, :40])


@pytest.mark.parametrize("backend", BACKENDS)
def test_embedding_raw_rows_and_repeated_ids(backend):
    table = torch.randn(7, 40).to(DEVICE).requires_grad_()
    ids = torch.tensor([3, 3, 0, 6, 3], device=DEVICE)
    out = dispatch.op("normalized_embedding", backend=backend)(ids, table, return_raw=True)
    assert torch.equal(out.raw, table.detach()[ids])
    (out.y.sum() + out.raw.sum()).backward()
    assert torch.equal(table.grad[[1, 2, 4, 5]], torch.zeros(4, 40, device=DEVICE))
    assert table.grad[3].abs().sum() > 0


def test_embedding_ids_out_of_range():
    table = torch.randn(7, 40)
    with pytest.raises(ContractViolation, match=r"'ids'.*inputs\.ids\.values.*\[0, 7\)"):
        dispatch.op("normalized_embedding")(torch.tensor([1, 7]), table)
    with pytest.raises(ContractViolation, match=r"'ids'.*inputs\.ids\.values"):
        dispatch.op("normalized_embedding")(torch.tensor([-1]), table)


def _embedding_grad_oracle(dy, d_raw, ids, table):
    """dtable in float64: each token's dx, summed per table row."""
    x = table.double()[ids]
    rstd = torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5)
    xhat = x * rstd
    g = dy.double()
    dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    if d_raw is not None:
        dx = dx + d_raw.double()
    return torch.zeros_like(table, dtype=torch.float64).index_add_(0, ids, dx)


@pytest.mark.parametrize("n_parts", [1, 15, 16, 17, 40])
def test_triton_sum_partials_adds_in_ascending_order(n_parts):
    """The weight gradient's partials: exactly (((0 + p0) + p1) + ...) in float32, for counts
    below, at and past the unrolled group of loads (its masked tail adds nothing)."""
    from opcontract.backends.triton import rms_norm as tn

    g = torch.Generator().manual_seed(n_parts)
    H = 100  # two column blocks, the second partial
    parts = torch.randn(n_parts, H, generator=g) * torch.logspace(-4, 4, n_parts).unsqueeze(1)
    parts[0, :3] = -0.0  # a -0 partial can't turn the sum into -0
    acc = torch.zeros(H)
    for i in range(n_parts):
        acc = acc + parts[i]
    # (the interpreter truncates float32 to bfloat16; the GPU rounds to nearest even)
    for dtype in (torch.float32, torch.bfloat16) if DEVICE == "cuda" else (torch.float32,):
        out = torch.empty(H, dtype=dtype, device=DEVICE)
        tn.sum_partials(parts.to(DEVICE), n_parts, out)
        assert torch.equal(out.cpu(), acc.to(dtype))


@pytest.mark.parametrize("with_raw", [False, True])
def test_triton_embedding_backward_is_exact_enough_deterministic_and_syncless(
    with_raw, monkeypatch
):
    """The table pass sums every row's tokens in ascending order, whole rows at a time:
    close to float64, equal run to run, zeros for unused rows, and no host sync (nothing in
    it reads a tensor's value on the host, so a CUDA graph can capture it)."""
    from opcontract.backends.triton import normalized_embedding as te

    g = torch.Generator().manual_seed(5)
    V, H, T = 9, 72, 13
    table = torch.randn(V, H, generator=g).to(DEVICE)
    ids = torch.tensor([4, 0, 4, 8, 4, 1, 0, 4, 8, 8, 0, 4, 1], device=DEVICE)  # 2,3,5,6,7 unused
    dy, d_raw = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
    dy, d_raw = dy.to(DEVICE), d_raw.to(DEVICE) if with_raw else None
    y, raw, rstd = te.embedding_forward(ids, table, 1e-5, True)

    def no_sync(*a, **k):
        raise AssertionError("host sync in the embedding backward")

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "nonzero", "__bool__"):
            m.setattr(torch.Tensor, name, no_sync)
        m.setattr(torch, "unique_consecutive", no_sync)
        first = te.embedding_backward(dy, d_raw, ids, table, rstd)
        again = te.embedding_backward(dy, d_raw, ids, table, rstd)
    assert torch.equal(first, again)
    assert torch.equal(first[[2, 3, 5, 6, 7]], torch.zeros(5, H, device=DEVICE))
    ref = _embedding_grad_oracle(dy, d_raw, ids, table)
    assert ((first.double() - ref).norm() / ref.norm()).item() < 1e-6


@pytest.mark.parametrize("with_raw", [False, True])
def test_triton_embedding_backward_adds_tokens_in_ascending_order(with_raw):
    """A row used by many tokens gets exactly the float32 left-to-right sum of its tokens'
    gradients, each computed alone (the same kernel on one-token calls). (The torch
    backend's float32 token gradients are not bitwise the kernel's, so they can't serve.)"""
    from opcontract.backends.triton import normalized_embedding as te

    g = torch.Generator().manual_seed(6)
    table = torch.randn(3, 40, generator=g).to(DEVICE)
    ids = torch.tensor([1, 2, 1, 1, 0, 1, 1], device=DEVICE)
    dy = (torch.randn(7, 40, generator=g) * torch.logspace(-3, 3, 7).unsqueeze(1)).to(DEVICE)
    d_raw = torch.randn(7, 40, generator=g).to(DEVICE) if with_raw else None
    _, _, rstd = te.embedding_forward(ids, table, 1e-5, False)
    total = te.embedding_backward(dy, d_raw, ids, table, rstd)
    acc = torch.zeros(40, device=DEVICE)
    for t in (0, 2, 3, 5, 6):  # row 1's tokens, ascending
        one = slice(t, t + 1)
        draw = d_raw[one] if with_raw else None
        alone = te.embedding_backward(dy[one], draw, ids[one], table, rstd[one])
        acc = acc + alone[1]
    assert torch.equal(total[1], acc)


@pytest.mark.parametrize("with_raw", [False, True])
def test_triton_embedding_rows_per_program_keep_the_bits(with_raw, monkeypatch):
    """How many table rows a program writes moves no add: the same bits with rows of 0, 1
    and several tokens, the first and last rows, and a last program that is only partly
    inside the table."""
    from opcontract.backends.triton import normalized_embedding as te

    g = torch.Generator().manual_seed(8)
    V, H = 37, 40
    table = torch.randn(V, H, generator=g).to(DEVICE)
    ids = torch.tensor([0, 36, 5, 5, 17, 0, 5, 36, 20, 21, 22], device=DEVICE)
    dy = torch.randn(len(ids), H, generator=g).to(DEVICE)
    d_raw = torch.randn(len(ids), H, generator=g).to(DEVICE) if with_raw else None
    _, _, rstd = te.embedding_forward(ids, table, 1e-5, False)
    out = {}
    for rows in (1, 8):  # 37 programs, or 5 with the last one 5 rows long
        monkeypatch.setattr(te, "EMBED_ROWS", rows)
        out[rows] = te.embedding_backward(dy, d_raw, ids, table, rstd)
    assert torch.equal(out[1], out[8])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_embedding_grad_through_the_op_writes_every_row(dtype, monkeypatch):
    """Through the op (backend triton, y and raw both carrying gradients): table.grad within
    the contract's grad tolerance of float64, equal run to run, and rows no token used are
    exactly zero although every new float buffer starts as NaN (torch.empty poisoned): the
    table pass writes every row, so no zero-fill is needed."""
    from opcontract.contracts import load_all

    g = torch.Generator().manual_seed(7)
    V, H, T = 24, 48, 9
    table = torch.randn(V, H, generator=g).to(dtype).to(DEVICE)
    ids = torch.tensor([23, 0, 5, 23, 0, 23, 11, 23, 5], device=DEVICE)  # rows 0 and V - 1
    dy = torch.randn(T, H, generator=g).to(dtype).to(DEVICE)
    d_raw = torch.randn(T, H, generator=g).to(dtype).to(DEVICE)
    empty = torch.empty

    def poisoned(*a, **k):
        t = empty(*a, **k)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    op = dispatch.op("normalized_embedding", backend="triton")
    grads = []
    with monkeypatch.context() as m:
        m.setattr(torch, "empty", poisoned)
        for _ in range(2):
            leaf = table.clone().requires_grad_()
            out = op(ids, leaf, return_raw=True)
            torch.autograd.backward((out.y, out.raw), (dy, d_raw))
            grads.append(leaf.grad)
    assert grads[0].dtype == dtype
    assert torch.equal(grads[0], grads[1])
    unused = [v for v in range(V) if v not in (0, 5, 11, 23)]
    assert torch.equal(grads[0][unused], torch.zeros(len(unused), H, dtype=dtype, device=DEVICE))
    ref = _embedding_grad_oracle(dy, d_raw, ids, table)
    tol = load_all()["normalized_embedding"].grad_tolerance[str(dtype).split(".")[1]]
    assert ((grads[0].double() - ref).norm() / ref.norm()).item() <= tol


@pytest.mark.gpu
def test_triton_embedding_backward_never_syncs_the_host():
    """torch's sync debug mode turns any host synchronisation in the backward into an error
    (the kernels are compiled by a first call outside it)."""
    from opcontract.backends.triton import normalized_embedding as te

    g = torch.Generator(device="cuda").manual_seed(8)
    V, H, T = 3000, 1536, 700
    table = torch.randn(V, H, device="cuda", generator=g).bfloat16()
    ids = torch.randint(0, V, (T,), device="cuda", generator=g)
    dy = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    d_raw = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    _, _, rstd = te.embedding_forward(ids, table, 1e-5, False)
    for draw in (None, d_raw):
        eager = te.embedding_backward(dy, draw, ids, table, rstd)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = te.embedding_backward(dy, draw, ids, table, rstd)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(out, eager)
