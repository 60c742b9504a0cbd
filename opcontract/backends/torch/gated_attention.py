"""gated_attention in plain torch: the float64 oracle, the strict path (the contract's chunked
online softmax, elementwise float32 in a fixed order, every query row on its own), and the
conformance kit's input builder (a key store with its block table, queries that see it).

The strict path walks key blocks b = 0, 1, ... for every query row at once; a row for which
block b holds no visible key keeps its state unchanged (``torch.where``), which is the
contract's "a block with no visible key changes nothing". So a row's bits depend on its own
query, keys and values only: not on the rows beside it, nor on how the keys are stored.
"""

from __future__ import annotations

import math

import torch

from opcontract.backends.fixed_order import tree_sum
from opcontract.backends.placement import on_device
from opcontract.backends.torch import elementwise as ew
from opcontract.contracts import get_contract

_C = get_contract("gated_attention")
BLOCK = _C.reductions["key_blocks"].block  # 128 positions
CHUNK = _C.reductions["key_chunks"].block  # 512 positions
QBLOCK = _C.reductions["grad_dkv_queries"].block
LOG2E = math.log2(math.e)


def softmax_scale(D: int, scale: float | None) -> float:
    return D**-0.5 if scale is None else scale


def score_factor(D: int, scale: float | None) -> float:
    """c = float32(scale * log2(e)), formed in float64 and rounded once."""
    return float(torch.tensor(softmax_scale(D, scale) * LOG2E, dtype=torch.float32))


def visible(j, pos, klen, layer, window):
    """[..., J] bool: key positions j a query at pos sees (pos -1: none)."""
    vis = (j <= pos[..., None]) & (j < klen[..., None]) & (pos[..., None] >= 0)
    if layer == "local":
        vis = vis & (j > pos[..., None] - window)
    return vis


# ----------------------------------------------------------------------------- oracle
def reference(
    q, k, v, gate, positions, seq, block_rows, key_len, *, layer, window=None, scale=None
):
    """Float64 oracle (differentiable in q, k, v, gate): the output [T, Hq, D]."""
    T, Hq, D = q.shape
    G = Hq // k.shape[1]
    sc = softmax_scale(D, scale)
    rows = []
    for t in range(T):
        p, s = int(positions[t]), int(seq[t])
        n = int(key_len[s])
        j = torch.arange(n, device=q.device)
        vis = visible(j, positions[t : t + 1], key_len[s : s + 1], layer, window)[0]
        if p < 0 or not bool(vis.any()):
            rows.append(torch.zeros(Hq, D, dtype=torch.float64, device=q.device))
            continue
        j = j[vis]
        r = block_rows[s, j // BLOCK].long() + j % BLOCK
        kk = k[r].double().repeat_interleave(G, dim=1)  # [n, Hq, D]
        vv = v[r].double().repeat_interleave(G, dim=1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[t].double(), kk) * sc, dim=-1)
        rows.append(torch.einsum("hn,nhd->hd", w, vv))
    attn = torch.stack(rows) if rows else q.double().new_zeros(0, Hq, D)
    return attn * torch.sigmoid(gate.double())


# ----------------------------------------------------------------------------- inputs
def conformance_inputs(contract, case, dtype, *, sizes=None, seed=0, device="cpu", on_device=False):
    """A valid call for a conformance case: S sequences packed in N key rows (sequence s's
    keys at rows base_s + position), block_rows pointing at them, and T query rows spread
    over the sequences at strictly increasing positions per sequence (a few -1 rows). The key
    layout depends on the sizes only (not the seed): padding queries built with another seed
    and T are valid against the same keys."""
    from opcontract.conformance.inputs import DTYPES

    dims = {**case.sizes, **(sizes or {})}
    T, Hq, Hkv, D, N, S, NB = (dims[x] for x in ("T", "Hq", "Hkv", "D", "N", "S", "NB"))
    params = {n: p.default for n, p in contract.params.items()}
    params.update(case.params)
    lens = [N // S + (1 if s < N % S else 0) for s in range(S)]
    lens = [min(n, NB * BLOCK) for n in lens]
    base = [sum(lens[:s]) for s in range(S)]
    block_rows = torch.full((S, NB), -1, dtype=torch.int64)
    for s in range(S):
        for b in range(-(-lens[s] // BLOCK)):
            block_rows[s, b] = base[s] + b * BLOCK
    gen = torch.Generator().manual_seed(seed)
    seq = torch.arange(T) % S
    positions = torch.full((T,), -1, dtype=torch.int64)
    for s in range(S):
        rows = (seq == s).nonzero()[:, 0]
        n = len(rows)
        picks = torch.randperm(lens[s], generator=gen)[:n].sort().values
        positions[rows[: len(picks)]] = picks
    if T > 3:
        positions[T // 2] = -1  # a row without a query
        seq_rows = (seq == seq[T // 2]).nonzero()[:, 0]
        keep = positions[seq_rows] >= 0  # still increasing where there are queries
        assert bool((positions[seq_rows][keep].diff() > 0).all())
    fdt = DTYPES[dtype]
    std = case.std

    def randn(*shape, name):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * std.get(name, 1.0)).to(
            fdt
        )

    inputs = {
        "q": randn(T, Hq, D, name="q"),
        "k": randn(N, Hkv, D, name="k"),
        "v": randn(N, Hkv, D, name="v"),
        "gate": randn(T, Hq, D, name="gate"),
        "positions": positions,
        "seq": seq,
        "block_rows": block_rows,
        "key_len": torch.tensor(lens, dtype=torch.int64),
    }
    return {k_: t.to(device) for k_, t in inputs.items()}, params


# ----------------------------------------------------------------------------- strict
def _gather(store, block_rows, seq, b):
    """[T, BLOCK, H, D] float32: block b of each query row's sequence (rows past the store
    read its last row: they are never visible)."""
    r = block_rows[seq, b].long().clamp(min=0)[:, None] + torch.arange(BLOCK, device=store.device)
    return store[r.clamp(max=store.shape[0] - 1)].float()


def _scores(q32, kb, G, c):
    """S2 [T, Hq, BLOCK] = (q . k) * c, the dot over D ascending."""
    ke = kb.repeat_interleave(G, dim=2).permute(0, 2, 1, 3)  # [T, Hq, BLOCK, D]
    acc = torch.zeros(ke.shape[:3], dtype=torch.float32, device=q32.device)
    for d in range(q32.shape[-1]):
        acc = acc + q32[:, :, d : d + 1] * ke[..., d]
    return acc * c


def _block_state(q32, k, v, block_rows, seq, positions, klen, b, G, c, layer, window, in_dtype):
    """(visible [T, BLOCK], S2, values [T, Hq, BLOCK, D]) of key block b for every row."""
    j = b * BLOCK + torch.arange(BLOCK, device=q32.device)
    vis = visible(j, positions, klen, layer, window)
    s2 = _scores(q32, _gather(k, block_rows, seq, b), G, c)
    s2 = torch.where(vis[:, None, :], s2, -math.inf)
    vb = _gather(v, block_rows, seq, b).repeat_interleave(G, dim=2).permute(0, 2, 1, 3)
    return vis, s2, vb


def _pv(p_in, vb, vis):
    """sum_j p[j] * v[j] over the block's visible keys (a fixed tree): [T, Hq, D]. A value the
    row does not see never enters (0 * inf would be NaN)."""
    prod = torch.where(vis[:, None, :, None], p_in[..., None] * vb, 0.0)
    return tree_sum(prod.transpose(-1, -2))


def strict_attention(q, k, v, positions, seq, block_rows, key_len, layer, window, scale):
    """(attn [T, Hq, D] float32, lse [T, Hq] float32): the contract's forward up to the gate."""
    T, Hq, D = q.shape
    G = Hq // k.shape[1]
    NB = block_rows.shape[1]
    dev = q.device
    c = score_factor(D, scale)
    q32 = q.float()
    klen = key_len[seq]
    f32 = dict(dtype=torch.float32, device=dev)
    run_m, run_l, run_o = (
        torch.full((T, Hq), -math.inf, **f32),
        torch.zeros(T, Hq, **f32),
        torch.zeros(T, Hq, D, **f32),
    )
    c_m = c_l = c_o = c_any = None
    per_chunk = CHUNK // BLOCK
    for b in range(NB):
        if b % per_chunk == 0:
            c_m, c_l, c_o = (
                torch.full((T, Hq), -math.inf, **f32),
                torch.zeros(T, Hq, **f32),
                torch.zeros(T, Hq, D, **f32),
            )
            c_any = torch.zeros(T, 1, dtype=torch.bool, device=dev)
        vis, s2, vb = _block_state(
            q32, k, v, block_rows, seq, positions, klen, b, G, c, layer, window, q.dtype
        )
        upd = vis.any(dim=1)[:, None]  # [T, 1]: the block holds a key this row sees
        c_m_new = torch.maximum(c_m, s2.amax(dim=-1))
        a = ew.exp2(torch.where(upd, c_m - c_m_new, 0.0))
        p = ew.exp2(s2 - torch.where(upd, c_m_new, 0.0)[..., None])
        c_l_new = c_l * a + tree_sum(p)
        c_o_new = c_o * a[..., None] + _pv(p.to(q.dtype).float(), vb, vis)
        c_m = torch.where(upd, c_m_new, c_m)
        c_l = torch.where(upd, c_l_new, c_l)
        c_o = torch.where(upd[..., None], c_o_new, c_o)
        c_any = c_any | upd
        if b % per_chunk == per_chunk - 1 or b == NB - 1:  # the chunk's partial merges
            has = c_any.expand(T, Hq)  # the chunk held a visible key (even at score -inf)
            run_m_new = torch.maximum(run_m, c_m)
            A = ew.exp2(torch.where(has, run_m - run_m_new, 0.0))
            Cc = ew.exp2(torch.where(has, c_m - run_m_new, 0.0))
            run_l = torch.where(has, run_l * A + c_l * Cc, run_l)
            run_o = torch.where(has[..., None], run_o * A[..., None] + c_o * Cc[..., None], run_o)
            run_m = torch.where(has, run_m_new, run_m)
    seen = run_l != 0  # no visible key: 0 (NaN stays NaN)
    attn = torch.where(seen[..., None], run_o / torch.where(seen, run_l, 1.0)[..., None], 0.0)
    attn = attn + 0.0  # a zero is +0, whichever way its products rounded
    lse = torch.where(seen, run_m + ew.log2(torch.where(seen, run_l, 1.0)), -math.inf)
    return attn, lse


def forward(config, q, k, v, gate, positions, seq, block_rows, key_len, *, layer, window, scale):
    """(out, lse, attn)."""
    positions, seq, block_rows, key_len = (
        on_device(t, q.device) for t in (positions, seq, block_rows, key_len)
    )
    attn, lse = strict_attention(q, k, v, positions, seq, block_rows, key_len, layer, window, scale)
    out = (attn * ew.sigmoid(gate.float())).to(q.dtype)
    return out, lse, attn


def backward(config, saved, grads, needs, *, layer, window, scale):
    q, k, v, gate = saved["q"], saved["k"], saved["v"], saved["gate"]
    positions, seq, block_rows, key_len = (
        on_device(saved[n], q.device) for n in ("positions", "seq", "block_rows", "key_len")
    )
    lse, attn = saved["lse"], saved["attn"]
    T, Hq, D = q.shape
    N, Hkv, _ = k.shape
    G = Hq // Hkv
    NB = block_rows.shape[1]
    g = grads["out"]
    g = torch.zeros_like(q, dtype=torch.float32) if g is None else g.float()
    s = ew.sigmoid(gate.float())
    d_gate = (g * attn * s * (1.0 - s)).to(gate.dtype)
    dA = g * s
    delta = tree_sum(dA * attn)  # [T, Hq]
    c = score_factor(D, scale)
    sc32 = torch.tensor(softmax_scale(D, scale), dtype=torch.float32)
    q32, dA_in = q.float(), dA.to(q.dtype).float()
    klen = key_len[seq]
    lse0 = torch.where(torch.isfinite(lse), lse, 0.0)
    dq = torch.zeros(T, Hq, D, dtype=torch.float32, device=q.device)
    dk = torch.zeros(N, Hkv, D, dtype=torch.float32, device=q.device)
    dv = torch.zeros_like(dk)
    by_seq = {}
    for t in sorted(range(T), key=lambda t: int(positions[t])):
        if int(positions[t]) >= 0:
            by_seq.setdefault(int(seq[t]), []).append(t)
    for b in range(NB):
        vis, s2, vb = _block_state(
            q32, k, v, block_rows, seq, positions, klen, b, G, c, layer, window, q.dtype
        )
        p = ew.exp2(s2 - lse0[..., None])  # 0 where masked
        ds = torch.where(vis[:, None, :], p * (_dot_d(dA_in, vb) - delta[..., None]), 0.0)
        ds = ds.to(q.dtype).float()
        kb = _gather(k, block_rows, seq, b).repeat_interleave(G, dim=2).permute(0, 2, 1, 3)
        dq = dq + tree_sum((ds[..., None] * kb).transpose(-1, -2))
        p_in = p.to(q.dtype).float()
        for sq, rows_t in by_seq.items():
            _add_kv(dk, dv, sq, b, rows_t, ds, p_in, q32, dA_in, positions, block_rows,
                    key_len, G)  # fmt: skip
    return {
        "q": (dq * sc32).to(q.dtype) if needs["q"] else None,
        "k": (dk * sc32).to(k.dtype) if needs["k"] else None,
        "v": dv.to(v.dtype) if needs["v"] else None,
        "gate": d_gate if needs["gate"] else None,
    }


def _dot_d(dA, vb):
    """dP [T, Hq, BLOCK] = dA . v over D, ascending (dA already in the input dtype)."""
    acc = torch.zeros(vb.shape[:3], dtype=torch.float32, device=dA.device)
    for d in range(dA.shape[-1]):
        acc = acc + dA[:, :, d : d + 1] * vb[..., d]
    return acc


def _add_kv(dk, dv, sq, b, rows_t, ds, p_in, q32, dA_in, positions, block_rows, key_len, G):
    """dk / scale and dv of key block b of sequence sq: its query rows (ascending positions)
    in blocks of QBLOCK positions, each block's terms summed (rows ascending, heads ascending)
    into a fresh partial, the partials added in ascending order."""
    row0 = int(block_rows[sq, b])
    n = min(BLOCK, int(key_len[sq]) - b * BLOCK)
    if row0 < 0 or n <= 0:
        return
    Hkv, D = dk.shape[1], dk.shape[2]
    tot_k = tot_v = None
    i = 0
    while i < len(rows_t):
        qb = int(positions[rows_t[i]]) // QBLOCK
        part_k = torch.zeros(Hkv, n, D, dtype=torch.float32, device=dk.device)
        part_v = torch.zeros_like(part_k)
        while i < len(rows_t) and int(positions[rows_t[i]]) // QBLOCK == qb:
            t = rows_t[i]
            for h in range(q32.shape[1]):
                kv = h // G
                part_k[kv] = part_k[kv] + ds[t, h, :n, None] * q32[t, h]
                part_v[kv] = part_v[kv] + p_in[t, h, :n, None] * dA_in[t, h]
            i += 1
        tot_k = part_k if tot_k is None else tot_k + part_k
        tot_v = part_v if tot_v is None else tot_v + part_v
    if tot_k is not None:
        rows = torch.arange(row0, row0 + n, device=dk.device)
        dk[rows] = dk[rows] + tot_k.transpose(0, 1)
        dv[rows] = dv[rows] + tot_v.transpose(0, 1)
