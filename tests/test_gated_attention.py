"""gated_attention: a token's output is the same bits in training, prefill (any chunking)
and decode (any step), alone or beside other sequences, left-padded or packed, whatever the
KV cache's pages and whenever it evicts; gradients of a sequence don't see its neighbours."""

import pytest
import torch
import triton
import triton.language as tl

from opcontract import ContractViolation, attention, dispatch
from opcontract.backends.torch.gated_attention import reference
from opcontract.backends.triton.gated_attention_kernels import _block_sum

HQ, HKV, D = 4, 2, 8


def _seqs(lengths, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        q = torch.randn(n, HQ, D, generator=g).to(dtype)
        k = torch.randn(n, HKV, D, generator=g).to(dtype)
        v = torch.randn(n, HKV, D, generator=g).to(dtype)
        gate = torch.randn(n, HQ, D, generator=g).to(dtype)
        out.append((q, k, v, gate))
    return out


def _packed(seqs, **kw):
    cat = [torch.cat([s[i] for s in seqs]) for i in range(4)]
    cu = torch.tensor([0, *torch.tensor([len(s[0]) for s in seqs]).cumsum(0).tolist()])
    return attention.packed(*cat, cu, **kw)


LAYERS = [dict(layer="global"), dict(layer="local", window=150)]
BACKENDS = ["torch", "triton"]  # Triton under the interpreter on the CPU


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    if request.param == "triton" and not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return request.param


@pytest.mark.parametrize("kw", LAYERS, ids=["global", "local"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_prefill_and_decode_give_a_token_the_same_bits(kw, dtype, backend):
    lengths = [530, 140, 7]  # across block (128) and chunk (512) edges and the window
    seqs = _seqs(lengths, dtype)
    train = _packed(seqs, backend=backend, **kw)
    offsets = [0, 530, 670]
    cache = attention.PagedKVCache(kv_heads=HKV, head_dim=D, dtype=dtype, device="cpu",
                                   sequences=3, pages=2, backend=backend, **kw)  # fmt: skip
    chunks = {0: [1, 127, 200, 190], 1: [64, 64], 2: [3]}  # then decode the rest
    done = [0, 0, 0]
    for step in range(4):
        seq_ids, pos, parts = [], [], []
        for s, sizes in chunks.items():
            if step < len(sizes):
                n = sizes[step]
                seq_ids += [s] * n
                pos += list(range(done[s], done[s] + n))
                parts.append((s, done[s], n))
                done[s] += n
        if not parts:
            continue
        rows = [slice(a, a + n) for s, a, n in parts]
        q, k, v, gate = (
            torch.cat([seqs[s][i][r] for (s, _, _), r in zip(parts, rows, strict=True)])
            for i in range(4)
        )
        out = cache.step(torch.tensor(seq_ids), torch.tensor(pos), q, k, v, gate)
        i = 0
        for s, a, n in parts:
            assert torch.equal(out[i : i + n], train[offsets[s] + a : offsets[s] + a + n])
            i += n
    while any(done[s] < lengths[s] for s in range(3)):  # decode: one token per live sequence
        live = [s for s in range(3) if done[s] < lengths[s]]
        q, k, v, gate = (torch.stack([seqs[s][i][done[s]] for s in live]) for i in range(4))
        out = cache.step(torch.tensor(live), torch.tensor([done[s] for s in live]), q, k, v, gate)
        for j, s in enumerate(live):
            assert torch.equal(out[j], train[offsets[s] + done[s]])
            done[s] += 1
    if kw["layer"] == "local":
        assert cache.pages_evicted > 0  # eviction happened, and changed nothing


@pytest.mark.parametrize("kw", LAYERS, ids=["global", "local"])
def test_alone_beside_others_and_left_padded_are_equal(kw, backend):
    seqs = _seqs([300, 45, 200], seed=1)
    kw = dict(kw, backend=backend)
    together = _packed(seqs, **kw)
    alone = _packed(seqs[2:], **kw)
    assert torch.equal(together[345:], alone)
    reordered = _packed([seqs[2], seqs[0], seqs[1]], **kw)
    assert torch.equal(reordered[:200], alone)
    L = 310  # the same sequences left-padded to one length
    pad = [torch.stack([torch.cat([torch.zeros(L - len(s[i]), *s[i].shape[1:]), s[i]])
                        for s in seqs]) for i in range(4)]  # fmt: skip
    mask = torch.stack([torch.cat([torch.zeros(L - len(s[0])), torch.ones(len(s[0]))])
                        for s in seqs])  # fmt: skip
    out = attention.padded(*pad, mask, **kw)
    assert torch.equal(out[2, L - 200 :], alone)
    assert torch.equal(out[0, L - 300 :], together[:300])
    assert not out[1, : L - 45].any()  # padding rows: 0


def test_eviction_timing_changes_nothing(backend):
    kw = dict(layer="local", window=100, backend=backend)
    (q, k, v, gate), = _seqs([300], seed=2)  # fmt: skip
    outs = []
    for every in (1, 7, None):
        cache = attention.PagedKVCache(kv_heads=HKV, head_dim=D, dtype=torch.float32,
                                       device="cpu", sequences=1, **kw)  # fmt: skip
        rows = []
        for p in range(300):
            rows.append(cache.step(torch.tensor([0]), torch.tensor([p]), q[p : p + 1],
                                   k[p : p + 1], v[p : p + 1], gate[p : p + 1],
                                   evict=every is not None and p % every == 0))  # fmt: skip
        outs.append(torch.cat(rows))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("kw", LAYERS, ids=["global", "local"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sequences_gradients_do_not_see_its_neighbours(kw, dtype, backend):
    seqs = _seqs([200, 33, 150], dtype, seed=3)

    def grads(group):
        leaves = [[t.clone().requires_grad_() for t in s] for s in group]
        out = _packed(leaves, backend=backend, **kw)
        n_last = len(group[-1][0])
        up = torch.randn(out[-n_last:].shape, generator=torch.Generator().manual_seed(9))
        (out[-n_last:].float() * up).sum().backward()
        return [t.grad for t in leaves[-1]]

    alone = grads(seqs[2:])
    beside = grads(seqs)
    for a, b in zip(alone, beside, strict=True):
        assert torch.equal(a, b)
    again = grads(seqs)  # run to run
    for a, b in zip(again, beside, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kw", LAYERS, ids=["global", "local"])
def test_gradients_against_float64(kw, backend):
    """dq, dk, dv and d gate of both backends within the contract's gradient tolerance of the
    float64 oracle's (float32 and bfloat16)."""
    from opcontract.contracts import get_contract

    tol = get_contract("gated_attention").grad_tolerance
    lengths = [200, 33, 150]
    pos = torch.cat([torch.arange(n) for n in lengths])
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    table = torch.tensor([[0, 128], [200, -1], [233, 361]])
    for dtype in (torch.float32, torch.bfloat16):
        cat = [torch.cat([s[i] for s in _seqs(lengths, dtype, seed=5)]) for i in range(4)]
        up = torch.randn(cat[0].shape, generator=torch.Generator().manual_seed(1)).to(dtype)
        leaves = [t.clone().requires_grad_() for t in cat]
        out = _packed([[t[a:b] for t in leaves] for a, b in ((0, 200), (200, 233), (233, 383))],
                      backend=backend, **kw)  # fmt: skip
        (out.float() * up.float()).sum().backward()
        oracle = [t.double().requires_grad_() for t in cat]
        ref = reference(*oracle, pos, seq, table, torch.tensor(lengths), **kw)
        (ref * up.double()).sum().backward()
        for name, a, r in zip("q k v gate".split(), leaves, oracle, strict=True):
            err = ((a.grad.double() - r.grad).norm() / r.grad.norm()).item()
            assert err < tol[str(dtype).split(".")[1]], (dtype, name, err)


def test_accuracy_against_float64():
    seqs = _seqs([260, 90], seed=4)
    cat = [torch.cat([s[i] for s in seqs]) for i in range(4)]
    out = _packed(seqs, layer="local", window=70)
    pos = torch.cat([torch.arange(260), torch.arange(90)])
    seq = torch.cat([torch.zeros(260), torch.ones(90)]).long()
    table = torch.tensor([[0, 128, 256], [260, -1, -1]])
    ref = reference(*(t.double() for t in cat), pos, seq, table, torch.tensor([260, 90]),
                    layer="local", window=70)  # fmt: skip
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


def test_bad_calls_are_violations():
    (q, k, v, gate), = _seqs([10])  # fmt: skip
    cu = torch.tensor([0, 10])
    with pytest.raises(ContractViolation, match="'window'.*must be None when layer='global'"):
        attention.packed(q, k, v, gate, cu, layer="global", window=5)
    with pytest.raises(ContractViolation, match="'window'.*required when layer='local'"):
        attention.packed(q, k, v, gate, cu, layer="local")
    with pytest.raises(ContractViolation, match="'q'.*multiple of the number of KV heads"):
        attention.packed(q[:, :3], k, v, gate[:, :3], cu, layer="global")
    with pytest.raises(ContractViolation, match="'k'.*D = 4 here but D = 8"):
        attention.packed(q, k[..., :4], v, gate, cu, layer="global")
    cache = attention.PagedKVCache(layer="global", kv_heads=HKV, head_dim=D,
                                   dtype=torch.float32, device="cpu", sequences=1)  # fmt: skip
    cache.step(torch.tensor([0]), torch.tensor([0]), q[:1], k[:1], v[:1], gate[:1])
    with pytest.raises(ContractViolation, match="next position is 1, got 3"):
        cache.step(torch.tensor([0]), torch.tensor([3]), q[:1], k[:1], v[:1], gate[:1])
    before = cache.k.clone()
    with pytest.raises(ContractViolation, match="bfloat16"):
        cache.step(torch.tensor([0]), torch.tensor([1]), q[:1], k[:1].bfloat16(), v[:1],
                   gate[:1])  # fmt: skip
    assert torch.equal(cache.k, before) and int(cache.lengths[0]) == 1  # nothing written
    for bad_q, bad_gate, name in ((q[:1].bfloat16(), gate[:1], "'q'"),
                                  (q[:1], gate[:1, :2], "'gate'"),
                                  (q[:1, :3], gate[:1, :3], "'q'")):  # fmt: skip
        with pytest.raises(ContractViolation, match=name):
            cache.step(torch.tensor([0]), torch.tensor([1]), bad_q, k[:1], v[:1], bad_gate)
        assert torch.equal(cache.k, before) and int(cache.lengths[0]) == 1
    with pytest.raises(ContractViolation, match="one entry per row of k"):
        cache.step(torch.tensor([0]), torch.tensor([1]), q[:0], k[:0], v[:0], gate[:0])
    with pytest.raises(ContractViolation, match="window"):
        attention.PagedKVCache(layer="global", window=8, kv_heads=HKV, head_dim=D,
                               dtype=torch.float32, device="cpu", sequences=1)  # fmt: skip
    # the op itself: a query that sees an evicted block
    pos, seq = torch.tensor([300]), torch.tensor([0])
    table = torch.tensor([[-1, 128, 256]])
    with pytest.raises(ContractViolation, match="'block_rows'.*absent"):
        dispatch.op("gated_attention")(q[:1], torch.randn(400, HKV, D), torch.randn(400, HKV, D),
                                       gate[:1], pos, seq, table, torch.tensor([301]),
                                       layer="global")  # fmt: skip


@pytest.mark.parametrize(
    "pos, seq, key_len, match",
    [
        ([5, 6], [0, 1], [301], "'seq'.*must lie in \\[0, 1\\)"),  # checked before the flags
        ([5, 5], [0, 0], [301], "two queries of sequence 0 at position 5"),
        ([300, -1], [0, 0], [300], "keys end at 300"),
        ([384, 1], [0, 0], [385], "needs block 3, but block_rows has 3"),
        ([-1, 7], [0, 0], [301], None),  # a row without a query beside a query: served
    ],
    ids=["seq-range", "duplicate", "beyond-keys", "short-table", "ok"],
)
def test_the_ops_value_checks_name_the_argument(pos, seq, key_len, match):
    """The index ranges and the op's own checks are read back together; a failing range is
    reported first (the checks index with seq clamped until then), then the first flag."""
    (q, k, v, gate), = _seqs([2])  # fmt: skip
    store = torch.randn(400, HKV, D)
    args = (q, store, store.clone(), gate, torch.tensor(pos), torch.tensor(seq),
            torch.tensor([[0, 128, 256]]), torch.tensor(key_len))  # fmt: skip
    f = dispatch.op("gated_attention")
    if match is None:
        assert f(*args, layer="global").shape == q.shape
        return
    with pytest.raises(ContractViolation, match=match):
        f(*args, layer="global")


@pytest.mark.parametrize("bounded", [False, True], ids=["read-back", "no-read-back"])
@pytest.mark.parametrize("kw", [dict(layer="global"), dict(layer="local", window=600)],
                         ids=["global", "local"])  # fmt: skip
def test_split_decode_gives_the_fused_bits(kw, bounded, monkeypatch):
    """Chunk partials in parallel then the ordered merge = the fused kernel, bitwise: in
    prefill chunks and decode steps across chunk (512) edges, against training. No read-back:
    the plan made from shapes alone (tiles padded to one per row, the split sized by the key
    table's width: what a GPU call that is small or being graph-captured takes)."""
    from opcontract.backends.triton import gated_attention as ga

    if bounded:
        monkeypatch.setattr(ga, "no_readback", lambda seq: True)
    lengths = [1100, 520, 9]
    seqs = _seqs(lengths, torch.bfloat16, seed=5)
    train = _packed(seqs, backend="triton", config={"split": 0}, **kw)
    offsets = [0, 1100, 1620]
    cache = attention.PagedKVCache(kv_heads=HKV, head_dim=D, dtype=torch.bfloat16,
                                   device="cpu", sequences=3, backend="triton",
                                   config={"split": 1}, **kw)  # fmt: skip
    prompt = [1090, 510, 3]
    for s, n in enumerate(prompt):  # prefill, split across up to 3 chunks a tile
        q, k, v, gate = (t[:n] for t in seqs[s])
        out = cache.step(torch.full((n,), s), torch.arange(n), q, k, v, gate)
        assert torch.equal(out, train[offsets[s] : offsets[s] + n])
    done = list(prompt)
    while any(done[s] < lengths[s] for s in range(3)):
        live = [s for s in range(3) if done[s] < lengths[s]]
        q, k, v, gate = (torch.stack([seqs[s][i][done[s]] for s in live]) for i in range(4))
        out = cache.step(torch.tensor(live), torch.tensor([done[s] for s in live]), q, k, v, gate)
        for j, s in enumerate(live):
            assert torch.equal(out[j], train[offsets[s] + done[s]]), (s, done[s])
            done[s] += 1


@pytest.mark.parametrize("kw", [dict(layer="global"), dict(layer="local", window=300)],
                         ids=["global", "local"])  # fmt: skip
def test_split_decode_redoes_non_finite_chunks_in_program(kw, monkeypatch):
    """Chunks with a NaN or infinity: the split kernel's in-program SAFE redo gives the fused
    kernel's two-pass bits, NaN for NaN, and the rows that never see the bad values finite."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    seqs = [list(t) for t in _seqs([700, 600, 40], torch.bfloat16, seed=11)]
    seqs[0][2][200, 1, 3] = float("nan")  # a value: group 1's rows that see it, channel 3
    seqs[1][1][100, 0, :] = float("inf")  # a key: group 0's rows that see it
    seqs[0][0][650, 2] = float("nan")  # one query row
    fused = _packed(seqs, backend="triton", config={"split": 0}, **kw)
    split = _packed(seqs, backend="triton", config={"split": 1}, **kw)
    torch.testing.assert_close(split, fused, rtol=0, atol=0, equal_nan=True)
    bad = fused.isnan().any(-1)  # rows: sequence 0 at 0, 1 at 700, 2 at 1300
    assert bad[200:700, 2:].any() and bad[800:1300, :2].any() and bad[650, 2]
    assert not bad[:200].any() and not bad[1300:].any() and not bad[700:800].any()
    if kw["layer"] == "local":  # past the window the bad key and value are out of sight
        assert not bad[500:650].any() and not bad[651:700].any() and not bad[1100:1300].any()


VARIANTS = [  # (split, interior, flat, reg_o, merge_in, merge_ahead, rows_first) beside
    # the plain kernels
    (0, 1, 0, 0, 0, 0, 0), (0, 0, 1, 0, 0, 0, 0), (0, 1, 1, 0, 0, 0, 0), (1, 1, 0, 0, 0, 0, 0),
    (0, 1, 0, 1, 0, 0, 0), (0, 0, 0, 1, 0, 0, 0), (1, 1, 0, 0, 1, 0, 0), (1, 1, 0, 0, 0, 1, 0),
    (1, 1, 0, 0, 1, 1, 0), (1, 1, 0, 0, 0, 0, 1), (1, 1, 0, 0, 1, 1, 1), (1, 1, 0, 0, 0, 0, 2),
    (1, 1, 0, 0, 1, 1, 2),
]


MERGE_CUTS = [(8, 1, 1), (16, 4, 0), (64, 2, 1)]  # split decode's merge: (cols, warps, ahead)


@pytest.mark.parametrize("kw", [dict(layer="global"), dict(layer="local", window=300)],
                         ids=["global", "local"])  # fmt: skip
def test_interior_blocks_and_the_flat_loop_give_the_same_bits(kw, monkeypatch):
    """``interior`` (blocks every live row of a tile sees whole skip the visibility mask),
    ``flat`` (the fused kernel's blocks in one loop, each chunk merged inside it) and
    ``reg_o`` (the running O in registers, not in the attn output between chunks) and
    ``merge_in`` (split decode's merge by each tile's last chunk program) and
    ``merge_ahead`` (the merge reading eight chunks ahead) and ``rows_first`` (a chunk's
    block rows read together before its blocks; 2: at the program's start), each with
    the tiles launched in either order (``heavy_first``): packed
    (tiles across sequence and window edges) and left-padded (rows without a query in a
    tile, and tiles without one), with a NaN value and an infinite key: the plain kernels'
    bits; so does the split merge cut into programs of 8 to 64 channels, with any warps,
    reading ahead or not (``MERGE_CUTS``)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    seqs = [list(t) for t in _seqs([700, 260, 9], torch.bfloat16, seed=13)]
    seqs[0][2][200, 1, 3] = float("nan")
    seqs[1][1][100, 0, :] = float("inf")
    base = {split: _packed(seqs, backend="triton", config={"split": split}, **kw)
            for split in (0, 1)}  # fmt: skip
    for split, interior, flat, reg_o, merge_in, merge_ahead, rows_first in VARIANTS:
        for heavy_first in (0, 1):
            cfg = {"split": split, "interior": interior, "flat": flat, "reg_o": reg_o,
                   "heavy_first": heavy_first, "merge_in": merge_in,
                   "merge_ahead": merge_ahead, "rows_first": rows_first}  # fmt: skip
            got = _packed(seqs, backend="triton", config=cfg, **kw)
            torch.testing.assert_close(got, base[split], rtol=0, atol=0, equal_nan=True,
                                       msg=str(cfg))  # fmt: skip
    for cols, warps, ahead in MERGE_CUTS:
        cfg = {"split": 1, "merge_cols": cols, "merge_warps": warps, "merge_ahead": ahead}
        got = _packed(seqs, backend="triton", config=cfg, **kw)
        torch.testing.assert_close(got, base[1], rtol=0, atol=0, equal_nan=True, msg=str(cfg))
    g = torch.Generator().manual_seed(3)
    B, L = 3, 300
    q, gate = (torch.randn(B, L, HQ, D, generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(B, L, HKV, D, generator=g).bfloat16() for _ in range(2))
    mask = torch.ones(B, L, dtype=torch.long)
    mask[1, :37] = 0  # left padding: a tile holds rows without a query
    mask[2, :250] = 0
    outs = [attention.padded(q, k, v, gate, mask, backend="triton",
                             config={"split": 0, "interior": i, "flat": i, "reg_o": r},
                             **kw)
            for i, r in ((0, 0), (1, 0), (1, 1))]  # fmt: skip
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    # split in two chunks, a row's tiles all without a query: merged apart and in-program
    q, k, v, gate = (torch.cat([t, t], dim=1) for t in (q, k, v, gate))
    mask = torch.ones(B, 2 * L, dtype=torch.long)
    mask[1, :37] = 0
    mask[2, :560] = 0
    outs = [attention.padded(q, k, v, gate, mask, backend="triton",
                             config={"split": 1, "merge_in": mi, "merge_ahead": ma}, **kw)
            for mi, ma in ((0, 0), (1, 0), (0, 1))]  # fmt: skip
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@triton.jit
def _row_sums_kernel(p_ptr, out_ptr, M: tl.constexpr, CUMSUM: tl.constexpr):
    r = tl.arange(0, M)
    c = tl.arange(0, 128)
    p = tl.load(p_ptr + r[:, None] * 128 + c[None, :])
    tl.store(out_ptr + r, _block_sum(p, 128, CUMSUM))


def _documented_row_sum(p: torch.Tensor) -> torch.Tensor:
    """The block row sum's order, one float32 addition at a time: key j = 8 u + 2 w + v;
    per w the keys (u, v) = (0, 0), (0, 1), (1, 0), ... one after another, then
    (S0 + S2) + (S1 + S3)."""
    x = p.reshape(p.shape[0], 16, 4, 2)
    sums = []
    for w in range(4):
        terms = [x[:, u, w, v] for u in range(16) for v in range(2)]
        acc = terms[0] + terms[1]
        for t in terms[2:]:
            acc = acc + t
        sums.append(acc)
    return (sums[0] + sums[2]) + (sums[1] + sums[3])


@pytest.mark.parametrize("rows", [16, 64, 128])
def test_the_block_row_sum_takes_its_documented_order(rows, monkeypatch):
    """``_block_sum`` adds a block's 128 weights in one written-out order (the one Triton
    3.6's ``tl.sum`` takes over a wgmma tile's rows), whatever the tile's size or layout:
    16-row decode tiles on ``mma.sync`` then sum as the 64- and 128-row tiles do. Both
    forms: the GPU's chain of additions and the interpreter's cumsum. Weights spread over
    2^-30 .. 2^30, so that another order gives other bits in some row."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(rows)
    p = torch.exp2(torch.randn(rows, 128, generator=g) * 10)
    for cumsum in (False, True):
        got = torch.empty(rows)
        _row_sums_kernel[(1,)](p, got, M=rows, CUMSUM=cumsum)
        assert torch.equal(got, _documented_row_sum(p)), cumsum
    left_to_right = p[:, 0].clone()
    for j in range(1, 128):
        left_to_right = left_to_right + p[:, j]
    assert not torch.equal(got, left_to_right)  # the order shows in the bits


def _grads(seqs, config, **kw):
    leaves = [[t.clone().requires_grad_() for t in s] for s in seqs]
    out = _packed(leaves, backend="triton", config=config, **kw)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.device)
    (out.float() * up).sum().backward()
    return [t.grad for s in leaves for t in s]


BWD_CONFIGS = [{"bwd_block_m": 128}, {"bwd_stages": 2, "bwd_warps": 4},
               {"bwd_block_m": 128, "bwd_stages": 2}, {"dkv_keys": 64},
               {"heavy_first": 1, "bwd_block_m": 128, "dkv_keys": 64}, {"dkv_t": 1},
               {"dkv_t": 1, "dkv_keys": 64, "bwd_stages": 2}]  # fmt: skip


@pytest.mark.parametrize("kw", LAYERS, ids=["global", "local"])
def test_the_backwards_launch_options_give_the_same_bits(kw, monkeypatch):
    """dq's tile rows (and their launch order), the backward kernels' warps and stages and
    the key rows a dk/dv program takes: every gradient's bits (and the output's)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    seqs = _seqs([300, 90], torch.bfloat16, seed=21)
    base = _grads(seqs, {}, **kw)
    for cfg in BWD_CONFIGS:
        for a, b in zip(_grads(seqs, cfg, **kw), base, strict=True):
            assert torch.equal(a, b), cfg


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [dict(layer="global"), dict(layer="local", window=2048)],
                         ids=["global", "local"])  # fmt: skip
def test_muse_geometry_training_prefill_and_split_decode_on_gpu(kw):
    """32 q heads on 2 KV heads, head_dim 128, bf16: the tensor cores give a token the same
    bits in a training tile, a prefill chunk's tile and a decode tile (64 rows on wgmma, or
    16 rows on mma.sync: one token's heads), fused or split, with
    the visibility mask on every block or only where a row doesn't see the whole block
    (``interior``: compiled for the GPU, a bare score product next to the subtraction would
    be contracted into an fma)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    L = 3000
    q, gate = (torch.randn(L, 32, 128, device="cuda", generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(L, 2, 128, device="cuda", generator=g).bfloat16() for _ in range(2))
    cu = torch.tensor([0, 1000, L])  # two sequences: a tile across their edge
    train = attention.packed(q, k, v, gate, cu, backend="triton", **kw)
    for cfg in ({"interior": 1}, {"interior": 1, "flat": 1}, {"num_stages": 3, "interior": 1},
                {"interior": 1, "reg_o": 1}, {"interior": 1, "reg_o": 1, "num_stages": 3},
                {"interior": 1, "reg_o": 1, "heavy_first": 1}):
        other = attention.packed(q, k, v, gate, cu, backend="triton", config=cfg, **kw)
        assert torch.equal(other, train), cfg
    cuts = [(0, 1000), (1000, L)]
    seqs = [tuple(t[a:b] for t in (q, k, v, gate)) for a, b in cuts]
    base = _grads(seqs, {}, **kw)
    for cfg in BWD_CONFIGS:
        for a, b in zip(_grads(seqs, cfg, **kw), base, strict=True):
            assert torch.equal(a, b), cfg
    train = attention.packed(q, k, v, gate, torch.tensor([0, L]), backend="triton", **kw)
    for split, interior, block_m, rows_first in ((0, 0, 64, 0), (1, 0, 64, 0), (0, 1, 64, 0),
                                                 (1, 1, 64, 0), (1, 1, 16, 0), (0, 1, 16, 0),
                                                 (1, 1, 16, 1), (1, 1, 64, 1), (1, 1, 16, 2),
                                                 (1, 1, 64, 2)):
        cache = attention.PagedKVCache(kv_heads=2, head_dim=128, dtype=torch.bfloat16,
                                       device="cuda", sequences=1, backend="triton",
                                       config={"split": split, "interior": interior,
                                               "block_m": block_m, "rows_first": rows_first},
                                       **kw)  # fmt: skip
        a = 0
        for n in (1, 127, 641, 2047, 179, 1, 1, 1, 1, 1):
            r = slice(a, a + n)
            out = cache.step(torch.zeros(n, dtype=torch.long), torch.arange(a, a + n), q[r],
                             k[r], v[r], gate[r])  # fmt: skip
            assert torch.equal(out, train[r]), (split, interior, block_m, rows_first, a, n)
            a += n


def test_tiles_cut_each_run_of_a_sequence_into_tiles():
    """The Triton plan's tile table (first row, tokens, sequence) against a plain walk over
    the rows, on random sequence layouts (sorted and interleaved, empty, int32 and int64)."""
    import random

    from opcontract.backends.triton.gated_attention import tiles

    def walk(s, per_tile):
        out, i = [], 0
        while i < len(s):
            j = i
            while j < len(s) and s[j] == s[i] and j - i < per_tile:
                j += 1
            out.append((i, j - i, s[i]))
            i = j
        return torch.tensor(out or [(0, 0, 0)], dtype=torch.int32)

    rng = random.Random(0)
    for _ in range(300):
        s = [rng.randrange(5) for _ in range(rng.randrange(40))]
        if rng.random() < 0.5:
            s.sort()
        seq = torch.tensor(s, dtype=rng.choice([torch.int32, torch.int64]))
        per_tile = rng.choice([1, 2, 3, 8, 16])
        want = walk(s, per_tile)
        assert torch.equal(tiles(seq, per_tile), want), (s, per_tile)
        padded = tiles(seq, per_tile, compact=False)  # T rows: the tiles, then empty ones
        n = want.shape[0] if s else 0
        assert padded.shape[0] == max(len(s), 1) and torch.equal(padded[:n], want[:n])
        assert bool((padded[n:, 1] == 0).all()), (s, per_tile)


def test_index_inputs_on_the_host_come_together():
    """The index inputs may be CPU tensors while the call runs elsewhere (meta stands in for
    a GPU here), all of them or none; any other placement names the argument."""
    from opcontract.dispatch.validate import bind, signature

    sig = signature("gated_attention")
    q, k = torch.empty(3, 4, 8, device="meta"), torch.empty(256, 2, 8, device="meta")
    index = dict(positions=torch.arange(3), seq=torch.zeros(3, dtype=torch.long),
                 block_rows=torch.tensor([[0, 128]]), key_len=torch.tensor([200]))  # fmt: skip
    kw = dict(layer="global")
    bound = bind(sig, (q, k, k, q), {**index, **kw})
    assert bound.device.type == "meta"
    with pytest.raises(ContractViolation, match="'seq'.*is on meta, but 'positions' is on the CPU"):
        bind(sig, (q, k, k, q), {**index, "seq": index["seq"].to("meta"), **kw})
    with pytest.raises(ContractViolation, match="'positions'.*is on meta, but 'q' is on cpu"):
        qc, kc = torch.empty(3, 4, 8), torch.empty(256, 2, 8)
        bind(sig, (qc, kc, kc, qc), {**index, "positions": index["positions"].to("meta"), **kw})


@pytest.mark.gpu
@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_host_index_inputs_give_the_device_bits_without_a_sync(backend_name):
    """Index inputs on the host: the same output and gradients as on the GPU, and the
    forward (value checks, tile table included) never waits for the GPU."""
    from opcontract.backends.torch.gated_attention import conformance_inputs
    from opcontract.contracts import get_contract

    c = get_contract("gated_attention")
    case = next(iter(c.conformance.cases))
    sizes = dict(T=40, Hq=8, Hkv=2, D=64, N=700, S=3, NB=3)
    host, params = conformance_inputs(c, case, "bfloat16", sizes=sizes)
    dev = {n: t.cuda() for n, t in host.items()}
    floats = ("q", "k", "v", "gate")
    f = dispatch.op("gated_attention", backend=backend_name)
    runs = []
    for index in (dev, host):
        x = {n: (dev[n].clone().requires_grad_() if n in floats else index[n]) for n in dev}
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if index is host else 0)
        try:
            out = f(**x, **params)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        out.float().square().sum().backward()
        runs.append((out, *(x[n].grad for n in floats)))
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)
    qk = dispatch.op("qk_norm_rope", backend=backend_name)
    pos = host["positions"].clamp(min=0)
    kw = dict(layer="local", rope_theta=500000.0, qk_scale=3.87, eps=1e-5)
    kh = dev["gate"][:, :2].contiguous()
    on_dev = qk(dev["q"], kh, pos.cuda(), **kw)
    on_host = qk(dev["q"], kh, pos, **kw)
    assert torch.equal(on_dev.q_out, on_host.q_out) and torch.equal(on_dev.k_out, on_host.k_out)


@pytest.mark.gpu
@pytest.mark.parametrize("split", [0, 1])
def test_decode_step_captured_in_a_cuda_graph_gives_the_eager_bits(split):
    """A decode step with its index inputs on the GPU is capturable (its plan reads nothing
    back): replayed on new queries and keys it gives the eager call's bits."""
    g = torch.Generator(device="cuda").manual_seed(1)
    B, L = 4, 1500
    k, v = (torch.randn(B * L, 2, 128, device="cuda", generator=g).bfloat16() for _ in range(2))
    nb = -(-L // 128)
    block_rows = (torch.arange(B, device="cuda")[:, None] * L
                  + 128 * torch.arange(nb, device="cuda")[None, :])  # fmt: skip
    key_len = torch.tensor([L, L - 7, 900, 1], device="cuda")
    positions, seq = key_len - 1, torch.arange(B, device="cuda")
    f = dispatch.op("gated_attention", backend="triton", config={"split": split})

    def inputs():
        return (torch.randn(B, 32, 128, device="cuda", generator=g).bfloat16() for _ in range(2))

    q, gate = inputs()
    kw = dict(layer="local", window=2048)
    f(q, k, v, gate, positions, seq, block_rows, key_len, **kw)  # compile, warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = f(q, k, v, gate, positions, seq, block_rows, key_len, **kw)
    for _ in range(3):
        q2, gate2 = inputs()
        q.copy_(q2)
        gate.copy_(gate2)
        graph.replay()
        assert torch.equal(out, f(q2, k, v, gate2, positions, seq, block_rows, key_len, **kw))



def test_host_checks_agree_with_the_torch_checks(monkeypatch):
    """The host forms of the call checks (Python lists below 32 queries, numpy above) hold
    exactly where the torch form sets no flag, over random layouts of which many break a
    check."""
    from opcontract.backends import gated_attention as checks

    host_form = checks._holds_on_host
    monkeypatch.setattr(checks, "_holds_on_host", lambda *a: False)  # check_call: torch form
    g = torch.Generator().manual_seed(7)
    verdicts = []
    for _ in range(400):
        S, NB, T = (int(torch.randint(1, n, (1,), generator=g)) for n in (5, 9, 64))
        rows = torch.randint(0, 4096, (S, NB), generator=g)
        rows[torch.rand(S, NB, generator=g) < 0.02] = -1
        key_len = torch.randint(1, NB * 128 + 1, (S,), generator=g)
        seq = torch.randint(0, S, (T,), generator=g)
        rank = (seq[:, None] == seq[None, :]).tril(-1).sum(1)  # earlier tokens of its sequence
        near = (key_len[seq] - 1 - rank).clamp(min=-1)  # distinct, inside the keys
        anywhere = torch.randint(-1, NB * 128 + 40, (T,), generator=g)
        pos = torch.where(torch.rand(T, generator=g) < 0.97, near, anywhere)
        for params in ({"layer": "global", "window": None},
                       {"layer": "local", "window": int(torch.randint(1, 700, (1,)))}):  # fmt: skip
            index = dict(positions=pos, seq=seq, block_rows=rows, key_len=key_len)
            pending = checks.check_call(index, params)
            holds = pending is None or not pending[0].any()
            assert host_form(pos, seq, rows, key_len, params) == holds, (S, NB, T, params)
            verdicts.append((T >= 32, holds))
    for numpy_form in (False, True):  # both forms, each with both verdicts well represented
        v = [holds for big, holds in verdicts if big == numpy_form]
        assert 20 < sum(v) < len(v) - 20, numpy_form


def test_index_inputs_packed_into_one_int32_copy_keep_their_values_and_shapes():
    from opcontract.backends.placement import on_device_int32

    ts = (torch.tensor([5, -1, 7]), torch.arange(12).view(3, 4) - 1,
          torch.tensor([9], dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int32))  # fmt: skip
    out = on_device_int32(ts, torch.device("cpu"))
    for a, b in zip(ts, out, strict=True):
        assert b.dtype == torch.int32 and b.shape == a.shape and torch.equal(b.long(), a.long())
    assert out[0].untyped_storage().data_ptr() == out[3].untyped_storage().data_ptr()  # one copy


def test_repeated_no_grad_calls_take_the_checked_forward_plan(monkeypatch):
    """Triton, host index inputs, no grad: after one call of a signature the next ones run
    the forward plan, not the shell's full path (the same bits), and a call whose positions
    break a check still raises first."""
    from opcontract.backends.torch.gated_attention import conformance_inputs
    from opcontract.contracts import get_contract
    from opcontract.dispatch import call_cache, shell

    call_cache.clear()
    c = get_contract("gated_attention")
    case = next(iter(c.conformance.cases))
    sizes = dict(T=8, Hq=4, Hkv=2, D=16, N=300, S=2, NB=3)
    x, params = conformance_inputs(c, case, "float32", sizes=sizes)
    full = []
    real = shell.OpShell.run_forward
    monkeypatch.setattr(
        shell.OpShell, "run_forward", lambda *a, **k: full.append(1) or real(*a, **k)
    )
    f = dispatch.op("gated_attention", backend="triton")
    args = [x[n] for n in ("q", "k", "v", "gate", "positions", "seq", "block_rows", "key_len")]
    with torch.no_grad():
        outs = [f(*args, **params) for _ in range(3)]
        assert len(full) == 1  # the first call; the plan served the other two
        assert all(torch.equal(outs[0], o) for o in outs[1:])
        live = [i for i in range(8) if int(x["positions"][i]) >= 0]
        same = [i for i in live if int(x["seq"][i]) == int(x["seq"][live[0]])]
        bad = x["positions"].clone()
        bad[same[1]] = bad[same[0]]  # two queries of one sequence at one position
        with pytest.raises(ContractViolation, match="positions"):
            f(*args[:4], bad, *args[5:], **params)
    call_cache.clear()


def test_chunk_count_on_the_host_matches_the_kernels_rule():
    """chunks_per_tile over host tensors (a Python walk below FEW_ROWS rows, numpy above)
    against the rule written out per tile, on random layouts with padding rows."""
    from opcontract.backends.torch.gated_attention import CHUNK
    from opcontract.backends.triton.gated_attention import chunks_per_tile, tiles

    g = torch.Generator().manual_seed(11)
    sizes = set()
    for _ in range(300):
        T = int(torch.randint(1, 90, (1,), generator=g))
        seq = torch.randint(0, 6, (T,), generator=g).sort().values
        pos = torch.randint(-1, 9000, (T,), generator=g)
        table = tiles(seq, int(torch.randint(1, 17, (1,), generator=g)))
        for local in (False, True):
            want = 0
            for row0, n, _ in table.tolist():
                live = [p for p in pos[row0 : row0 + n].tolist() if p >= 0]
                if live:
                    lo = max(min(live) - 2047, 0) if local else 0
                    want = max(want, max(live) // CHUNK - lo // CHUNK + 1)
            assert chunks_per_tile(table, pos, 2048, local) == want, (T, local)
        sizes.add(T >= 32)
    assert sizes == {False, True}


def _split_decode_plan(position: int, config=None, layer: str = "global", window=None):
    """The Triton plan (no kernel runs) of one decode token at ``position`` of a sequence
    whose blocks 0 .. position // 128 are cached, split decode unless ``config`` says."""
    from opcontract.backends.triton import gated_attention as tga

    q = torch.zeros(1, HQ, D, dtype=torch.bfloat16)
    k = torch.zeros(1, HKV, D, dtype=torch.bfloat16)
    nb = position // 128 + 1
    return tga.plan_forward({"split": 1, **(config or {})}, q, k,
                            torch.tensor([position], dtype=torch.int32),
                            torch.zeros(1, dtype=torch.int32),
                            torch.arange(nb, dtype=torch.int32)[None], layer=layer,
                            window=window, scale=None)  # fmt: skip


@pytest.mark.parametrize("layer, window", [("global", 0), ("local", 2048)])
def test_merge_ahead_by_default_where_a_tile_spans_more_than_8_chunks(layer, window):
    """Default merge_ahead (-1): the split decode's read-ahead merge for a call whose tiles
    span more than 8 chunks of 512 positions (a global layer's token at position 4096 and
    beyond), not at 4095 or for a local layer's window of 2048 (5 chunks at most); an
    explicit 0 or 1 is kept. Only the plan is built (no kernel runs)."""

    def plan(position: int, config=None):
        return _split_decode_plan(position, config, layer, window)

    assert plan(4095).n_chunks == (8 if layer == "global" else 4)
    assert not plan(4095).merge_ahead
    assert plan(4096).merge_ahead == (layer == "global")
    assert plan(32767).merge_ahead == (layer == "global")
    assert not plan(8192, {"merge_ahead": 0}).merge_ahead
    assert plan(1000, {"merge_ahead": 1}).merge_ahead  # two chunks


def test_merge_cols_by_default_the_fewest_that_keep_four_merge_programs_an_sm():
    """Default merge_cols (-1): 8, 16 or 32 channels a merge program, the fewest that leave
    at most four programs an SM (16-row tiles: 128 / cols programs a tile and KV head), else
    32; off the GPU (no SMs) 32; an explicit value is kept. Only plans are built."""
    from opcontract.backends.triton import gated_attention as tga

    assert tga.merge_cols(2, 16, 128, 132) == 8  # B = 1: 32 programs
    assert tga.merge_cols(16, 16, 128, 132) == 8  # B = 8: 256
    assert tga.merge_cols(64, 16, 128, 132) == 16  # B = 32: 1024 at 8 channels, 512 at 16
    assert tga.merge_cols(128, 16, 128, 132) == 32  # B = 64: 512 at 32 channels
    assert tga.merge_cols(512, 16, 128, 132) == 32  # B = 256: more than four an SM at any width
    assert tga.merge_cols(33, 64, 128, 132) == 32  # 64-row tiles: four row groups a tile
    assert tga.merge_cols(2, 16, 128, 0) == 32
    assert _split_decode_plan(8192).merge_cols == 32  # CPU
    assert _split_decode_plan(8192, {"merge_cols": 8}).merge_cols == 8


def test_decode_stages_three_only_where_split_programs_read_rows_first_in_one_wave():
    """A decode call's default stages (num_stages -1): three where the split programs read
    their block rows first and fit one an SM, else two; a plan off the GPU (no SMs) and an
    explicit num_stages keep two and what was asked. Only plans are built (no kernel runs)."""
    from opcontract.backends.triton import gated_attention as tga

    assert tga.decode_stages(32, True, 132) == 3
    assert tga.decode_stages(132, True, 132) == 3
    assert tga.decode_stages(133, True, 132) == 2
    assert tga.decode_stages(32, False, 132) == 2
    assert tga.decode_stages(0, True, 132) == 2
    default = _split_decode_plan(4000)
    assert default.split and default.rows_first and default.meta["num_stages"] == 2  # CPU
    assert _split_decode_plan(4000, {"num_stages": 3}).meta["num_stages"] == 3
    assert not _split_decode_plan(4000, {"rows_first": 0}).rows_first
