"""gated_attention on the GPU at Muse Glimmer's geometry: invariance counted for opcontract's
Triton path and the peers the same way, throughput side by side, decode bandwidth.

    python benchmarks/attention.py --out benchmarks/results/attention_h200.json \
        [--parts invariance,configs,peers,train,prefill,decode] [--tiny]

Invariance is ``torch.equal`` per token (a token differs if any of its elements does);
each count says how many tokens were compared and how many differed, and names the first.
The peers attend without the gate (they have none); opcontract's outputs include it.
``--tiny`` runs small shapes on the CPU under the Triton interpreter (a smoke test).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from opcontract import attention  # noqa: E402

WINDOW = 2048


class Geometry:
    def __init__(self, tiny: bool) -> None:
        self.tiny = tiny
        self.hq, self.hkv, self.d = (4, 2, 16) if tiny else (32, 2, 128)
        self.dtype = torch.bfloat16
        self.dev = "cpu" if tiny else "cuda"
        self.window = 150 if tiny else WINDOW

    def seq(self, n: int, seed: int, requires_grad: bool = False):
        g = torch.Generator(device=self.dev).manual_seed(seed)

        def r(h):
            t = torch.randn(n, h, self.d, generator=g, device=self.dev).to(self.dtype)
            return t.requires_grad_(requires_grad)

        return r(self.hq), r(self.hkv), r(self.hkv), r(self.hq)

    def layer(self, kind: str) -> dict:
        return dict(layer="local", window=self.window) if kind == "local" else dict(layer="global")


def _cat(parts):
    return [torch.cat([p[i] for p in parts]) for i in range(4)]


def _cu(lengths, dev):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=dev)


def count(pairs) -> dict:
    """{"tokens", "differ", "first"} over (label, a, b) pairs of [n, ...] tensors."""
    tokens = differ = 0
    first = None
    for label, a, b in pairs:
        ne = (a != b).reshape(a.shape[0], -1).any(dim=1)
        ne = ne & ~(
            torch.isnan(a).reshape(a.shape[0], -1).all(1)
            & torch.isnan(b).reshape(a.shape[0], -1).all(1)
        )
        tokens += a.shape[0]
        k = int(ne.sum())
        differ += k
        if k and first is None:
            i = int(ne.nonzero()[0])
            d = (a[i].float() - b[i].float()).abs().max().item()
            first = f"{label}: token {i}, max |diff| {d:.3g}"
    return {"tokens": tokens, "differ": differ, "first": first}


# ------------------------------------------------------------------ opcontract invariance
def ours_invariance(G: Geometry, kind: str, L: int, decode_steps: int) -> dict:
    kw = dict(G.layer(kind), backend="triton")
    main = G.seq(L, 1)
    others = [G.seq(n, 10 + i) for i, n in enumerate((3000 if not G.tiny else 300, 777))]
    alone = attention.packed(*main, _cu([L], G.dev), **kw)
    lengths = [others[0][0].shape[0], L, others[1][0].shape[0]]
    beside = attention.packed(*_cat([others[0], main, others[1]]), _cu(lengths, G.dev), **kw)
    beside = beside[lengths[0] : lengths[0] + L]
    res = {"L": L, "alone_vs_beside_training": count([("beside", alone, beside)])}
    # prefill in uneven chunks across block (128), chunk (512) and window edges, then decode
    sizes = [1, 127, 1, 383, 2047, 2, 4096] if not G.tiny else [1, 127, 1, 70]
    pre = []
    for n in sizes:
        if sum(pre) + n > L - decode_steps:
            break
        pre.append(n)
    pre.append(L - decode_steps - sum(pre))
    for evict_every in (1, 0):
        cache = attention.PagedKVCache(kv_heads=G.hkv, head_dim=G.d, dtype=G.dtype,
                                       device=G.dev, sequences=1, **kw)  # fmt: skip
        pairs, a = [], 0
        for n in pre:
            r = slice(a, a + n)
            out = cache.step(torch.zeros(n, dtype=torch.long), torch.arange(a, a + n),
                             *(t[r] for t in main), evict=evict_every == 1)  # fmt: skip
            pairs.append((f"prefill {a}..{a + n - 1}", out, alone[r]))
            a += n
        dec = []
        for i in range(a, L):
            r = slice(i, i + 1)
            out = cache.step(torch.zeros(1, dtype=torch.long), torch.tensor([i]),
                             *(t[r] for t in main), evict=evict_every == 1)  # fmt: skip
            dec.append((f"decode {i}", out, alone[r]))
        tag = "evict_each_step" if evict_every else "never_evict"
        res[f"training_vs_prefill_{tag}"] = count(pairs)
        res[f"training_vs_decode_{tag}"] = count(dec)
        res[f"pages_evicted_{tag}"] = cache.pages_evicted
    res["prefill_chunks"] = pre
    return res


def ours_decode_batches(G: Geometry, kind: str, B: int, max_len: int) -> dict:
    """B sequences of random lengths; one decode token each: the batch's output for a
    sequence against it alone, in sub-batches, reversed, and against training."""
    kw = dict(G.layer(kind), backend="triton")
    g = torch.Generator().manual_seed(B)
    lens = torch.randint(1, max_len, (B,), generator=g).tolist()
    seqs = [G.seq(n + 1, 100 + s) for s, n in enumerate(lens)]
    train = attention.packed(*_cat(seqs), _cu([n + 1 for n in lens], G.dev), **kw)
    ends = torch.tensor([n + 1 for n in lens]).cumsum(0) - 1
    cache = attention.PagedKVCache(kv_heads=G.hkv, head_dim=G.d, dtype=G.dtype, device=G.dev,
                                   sequences=B, pages=sum(-(-n // 128) for n in lens) + B,
                                   **kw)  # fmt: skip
    seq = torch.cat([torch.full((n,), s) for s, n in enumerate(lens)])
    pos = torch.cat([torch.arange(n) for n in lens])
    prompt = _cat([[t[:-1] for t in s] for s in seqs])
    cache.append(seq, pos, prompt[1], prompt[2])
    last = _cat([[t[-1:] for t in s] for s in seqs])
    ids, at = torch.arange(B), torch.tensor(lens)
    cache.append(ids, at, last[1], last[2])
    full = cache.attend(ids, at, last[0], last[3])
    pairs = [("training", full, train[ends.to(G.dev)])]
    rev = torch.arange(B - 1, -1, -1)
    pairs.append(
        ("reversed", cache.attend(ids[rev], at[rev], last[0][rev], last[3][rev]).flip(0), full)
    )
    for sub in sorted({1, 8, B // 2}):
        if 0 < sub < B:
            part = cache.attend(ids[:sub], at[:sub], last[0][:sub], last[3][:sub])
            pairs.append((f"first {sub}", part, full[:sub]))
    return {"B": B, "max_len": max(lens), "vs": count(pairs)}


def ours_run_to_run_and_neighbours(G: Geometry, kind: str, L: int) -> dict:
    kw = dict(G.layer(kind), backend="triton")

    def grads(parts, at):
        leaves = [[t.detach().clone().requires_grad_(True) for t in p] for p in parts]
        lengths = [p[0].shape[0] for p in parts]
        out = attention.packed(*_cat(leaves), _cu(lengths, G.dev), **kw)
        # each sequence's upstream gradient from its own seed: the main one's is the same
        # wherever it sits
        w = (
            torch.cat(
                [
                    torch.randn(
                        p[0].shape, generator=torch.Generator().manual_seed(7 if i == at else 8 + i)
                    )
                    for i, p in enumerate(parts)
                ]
            )
            .to(out.dtype)
            .to(G.dev)
        )
        (out.float() * w.float()).sum().backward()
        return out.detach(), [t.grad for t in leaves[at]], lengths

    main = G.seq(L, 3)
    o1, g1, _ = grads([main], 0)
    o2, g2, _ = grads([main], 0)
    nb = [G.seq(1000 if not G.tiny else 100, 4), main, G.seq(333, 5)]
    o3, g3, lengths = grads(nb, 1)
    names = ("q", "k", "v", "gate")
    return {
        "L": L,
        "run_to_run": count(
            [("out", o1, o2)] + [(n, a, b) for n, a, b in zip(names, g1, g2, strict=True)]
        ),
        "gradients_alone_vs_packed": count(
            [(n, a, b) for n, a, b in zip(names, g1, g3, strict=True)]
        ),
    }


def ours_configs(G: Geometry) -> dict:
    """Every config of the Triton forward against the default, bitwise (the tuner's free
    choices): split decode, warps, stages; decode at B = 1 and B = 8, and training."""
    from opcontract import dispatch

    res = []
    if G.tiny:
        cases = [
            ("decode B=1", [1500], 1),
            ("decode B=8", [40, 900, 1, 129, 512, 513, 700, 300], 1),
            ("prefill 200 on 600", [800], 200),
            ("training 400", [400], 400),
        ]
    else:
        cases = [
            ("decode B=1 L=32768", [32767], 1),
            ("decode B=8", [4000, 9000, 1, 129, 512, 513, 20000, 2048], 1),
            ("prefill 2048 on 6144", [8192], 2048),
            ("training 4096", [4096], 4096),
        ]
    for kind in ("global", "local"):
        for label, lens, nq in cases:
            seqs = [G.seq(n, 50 + i) for i, n in enumerate(lens)]
            k = torch.cat([s[1] for s in seqs])
            v = torch.cat([s[2] for s in seqs])
            q = torch.cat([s[0][-nq:] for s in seqs])
            gate = torch.cat([s[3][-nq:] for s in seqs])
            pos = torch.cat([torch.arange(n - nq, n) for n in lens]).to(G.dev)
            sq = torch.cat([torch.full((nq,), i) for i in range(len(lens))]).to(G.dev)
            nb = max(-(-n // 128) for n in lens)
            table = torch.full((len(lens), nb), -1, dtype=torch.long)
            off = 0
            for i, n in enumerate(lens):
                table[i, : -(-n // 128)] = off + 128 * torch.arange(-(-n // 128))
                off += n
            args = (q, k, v, gate, pos, sq, table.to(G.dev), torch.tensor(lens).to(G.dev))
            kw = G.layer(kind)
            ref = dispatch.op("gated_attention", backend="triton", config={"split": 0})(*args, **kw)
            for cfg in ({"split": 1}, {"block_m": 128}, {"num_warps": 4}, {"num_stages": 2},
                        {"split": 1, "block_m": 128}):  # fmt: skip
                try:
                    f = dispatch.op("gated_attention", backend="triton", config=cfg)
                    row = count([("out", f(*args, **kw), ref)])
                except Exception as e:  # noqa: BLE001
                    row = {"error": repr(e)[:300]}
                res.append({"layer": kind, "case": label, "config": cfg, **row})
    return {"rows": res}


# ------------------------------------------------------------------ peers
def _fa4():
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

        return flash_attn_func, flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001
        print("FA4 unavailable:", repr(e)[:200])
        return None


def _out(r):
    """FA4's functions return (out, lse)."""
    return r[0] if isinstance(r, tuple) else r


def _sdpa(q, k, v, qpos, kpos, window):
    """SDPA over [B, L, H, D] with the mask built from positions (kpos -1: padding)."""
    import torch.nn.functional as F

    vis = (kpos[:, None, :] <= qpos[:, :, None]) & (kpos[:, None, :] >= 0)
    if window:
        vis &= kpos[:, None, :] > qpos[:, :, None] - window
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=vis[:, None], enable_gqa=True)  # fmt: skip
    return o.transpose(1, 2)


def peer_invariance(G: Geometry, L: int, decode_steps: int) -> dict:
    fa = _fa4()
    out = {}
    q, k, v, _ = (t[None] for t in G.seq(L, 1))  # [1, L, H, D]
    pos = torch.arange(L, device=G.dev)[None]
    providers = {"sdpa": None}
    if fa:
        providers["fa4"] = False
        providers["fa4_deterministic"] = True
    for kind in ("global", "local"):
        win = G.window if kind == "local" else 0
        for name, det in providers.items():
            if name == "sdpa":

                def run(qq, kk, vv, qp, kp, win=win):
                    return _sdpa(qq, kk, vv, qp, kp, win)
            else:

                def run(qq, kk, vv, qp, kp, win=win, det=det):
                    ws = (win - 1, 0) if win else (None, None)
                    return _out(fa[0](qq, kk, vv, causal=True, window_size=ws, deterministic=det))

            with torch.no_grad():
                full = run(q, k, v, pos, pos)[0]
                pairs, a = [], 0
                for n in (1, 127, 1, 383, 2047, 2, 4096, L):
                    n = min(n, L - decode_steps - a)
                    if n <= 0:
                        break
                    o = run(q[:, a : a + n], k[:, : a + n], v[:, : a + n], pos[:, a : a + n],
                            pos[:, : a + n])[0]  # fmt: skip
                    pairs.append((f"prefill {a}", o, full[a : a + n]))
                    a += n
                dec, ev = [], []
                for i in range(L - decode_steps, L):
                    o = run(q[:, i : i + 1], k[:, : i + 1], v[:, : i + 1], pos[:, i : i + 1],
                            pos[:, : i + 1])[0]  # fmt: skip
                    dec.append((f"decode {i}", o, full[i : i + 1]))
                    if win:  # a cache that kept only the window (evicted the rest)
                        lo = max(0, i - win + 1)
                        o2 = run(q[:, i : i + 1], k[:, lo : i + 1], v[:, lo : i + 1],
                                 pos[:, i : i + 1], pos[:, lo : i + 1])[0]  # fmt: skip
                        ev.append((f"evicted {i}", o2, o))
                row = {"training_vs_prefill": count(pairs), "training_vs_decode": count(dec)}
                if ev:
                    row["full_vs_evicted_cache"] = count(ev)
                # a decode token alone vs in a padded batch of 8 / 64 of other lengths
                for B in (8, 64):
                    g = torch.Generator(device=G.dev).manual_seed(B)
                    lens = [L] + torch.randint(1, L, (B - 1,), generator=g, device=G.dev).tolist()
                    kb = torch.zeros(B, L, G.hkv, G.d, dtype=G.dtype, device=G.dev)
                    vb = torch.zeros_like(kb)
                    qb = torch.randn(B, 1, G.hq, G.d, generator=g, device=G.dev).to(G.dtype)
                    qb[0] = q[0, L - 1]
                    kpos = torch.full((B, L), -1, device=G.dev)
                    for b, n in enumerate(lens):  # left-padded
                        src = (
                            k[0, :n]
                            if b == 0
                            else torch.randn(n, G.hkv, G.d, generator=g, device=G.dev).to(G.dtype)
                        )
                        kb[b, L - n :] = src
                        vb[b, L - n :] = v[0, :n] if b == 0 else src.flip(0)
                        kpos[b, L - n :] = torch.arange(n, device=G.dev)
                    qpos = torch.tensor(lens, device=G.dev)[:, None] - 1
                    if name == "sdpa":
                        ob = _sdpa(qb, kb, vb, qpos, kpos, win)
                    else:  # varlen: the batch packed, each sequence's own length
                        kk = torch.cat([kb[b, L - n :] for b, n in enumerate(lens)])
                        vv = torch.cat([vb[b, L - n :] for b, n in enumerate(lens)])
                        cuq = torch.arange(B + 1, device=G.dev, dtype=torch.int32)
                        cuk = _cu(lens, G.dev).to(torch.int32)
                        ws = (win - 1, 0) if win else (None, None)
                        r = fa[1](qb[:, 0], kk, vv, cu_seqlens_q=cuq, cu_seqlens_k=cuk,
                                  max_seqlen_q=1, max_seqlen_k=L, causal=True,
                                  window_size=ws)  # fmt: skip
                        ob = _out(r)[:, None]
                    row[f"decode_alone_vs_batch_{B}"] = count([("batch", ob[0], dec[-1][1])])
            out[f"{name}_{kind}"] = row
    return out


# ------------------------------------------------------------------ throughput
def _flops(L: int, B: int, hq: int, d: int, window: int | None) -> float:
    keys = sum(min(i + 1, window) if window else i + 1 for i in range(L))
    return 4.0 * B * hq * d * keys


def _time_providers(provs: dict, base: dict, fl: float, rows: list) -> None:
    """Forward, then forward+backward with its peak extra memory, per provider."""
    for name, fn in provs.items():
        try:
            with torch.no_grad():
                ms = common.bench(fn, rep_ms=200)
            rows.append(dict(base, provider=name, mode="forward", ms=ms[0],
                             tflops=fl / ms[0] / 1e9))  # fmt: skip
            print(rows[-1], flush=True)
            g = torch.randn_like(fn())

            def fb(fn=fn, g=g):
                fn().backward(g)

            mem = common.peak_extra_bytes(fb)
            ms = common.bench(fb, rep_ms=300)
            rows.append(dict(base, provider=name, mode="forward+backward", ms=ms[0],
                             tflops=3.5 * fl / ms[0] / 1e9, peak_extra_gb=mem / 1e9))  # fmt: skip
        except Exception as e:  # noqa: BLE001
            rows.append(dict(base, provider=name, error=repr(e)[:300]))
        print(rows[-1], flush=True)


def train_case(G: Geometry, L: int, B: int, kind: str, fa, rows: list) -> None:
    import torch.nn.functional as F

    win = G.window if kind == "local" else None
    seqs = [G.seq(L, 20 + b) for b in range(B)]
    q, k, v, gate = (torch.cat([s[i] for s in seqs]).requires_grad_(True) for i in range(4))
    cu = _cu([L] * B, G.dev)
    provs = {"opcontract": lambda: attention.packed(q, k, v, gate, cu, backend="triton",
                                                    **G.layer(kind)),
             "opcontract block_m=128": lambda: attention.packed(
                 q, k, v, gate, cu, backend="triton", config={"block_m": 128},
                 **G.layer(kind))}  # fmt: skip
    q4, k4, v4 = (t.detach().view(B, L, *t.shape[1:]).requires_grad_(True) for t in (q, k, v))
    ws = (win - 1, 0) if win else (None, None)
    if fa:
        provs["fa4"] = lambda: _out(fa[0](q4, k4, v4, causal=True, window_size=ws))
        provs["fa4_deterministic"] = lambda: _out(
            fa[0](q4, k4, v4, causal=True, window_size=ws, deterministic=True)
        )
    qs, ks, vs = (t.detach().view(B, L, *t.shape[1:]).transpose(1, 2).requires_grad_(True)
                  for t in (q, k, v))  # fmt: skip
    i = torch.arange(L, device=G.dev)
    mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - (win or L))
    if win:
        provs["sdpa"] = lambda: F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask,
                                                               enable_gqa=True)  # fmt: skip
    else:
        provs["sdpa"] = lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                                               enable_gqa=True)  # fmt: skip
    _time_providers(provs, dict(layer=kind, L=L, B=B), _flops(L, B, G.hq, G.d, win), rows)


def train_rows(G: Geometry, Ls, tokens: int) -> list[dict]:
    fa = _fa4()
    rows: list[dict] = []
    for L in Ls:
        for kind in ("global", "local"):
            train_case(G, L, max(1, tokens // L), kind, fa, rows)
            torch.cuda.empty_cache()
    return rows


def prefill_case(G: Geometry, B: int, kind: str) -> dict:
    """A chunk of 2048 new tokens per sequence against a cache of 6144."""
    cache = attention.PagedKVCache(kv_heads=G.hkv, head_dim=G.d, dtype=G.dtype, device=G.dev,
                                   sequences=B, pages=B * 64 + 8, backend="triton",
                                   **G.layer(kind))  # fmt: skip
    seqs = [G.seq(8192, 60 + b) for b in range(B)]
    seq = torch.cat([torch.full((6144,), b) for b in range(B)])
    cache.append(seq, torch.arange(6144).repeat(B), torch.cat([s[1][:6144] for s in seqs]),
                 torch.cat([s[2][:6144] for s in seqs]))  # fmt: skip
    seq2 = torch.cat([torch.full((2048,), b) for b in range(B)])
    pos2 = torch.arange(6144, 8192).repeat(B)
    q, k, v, gate = (torch.cat([s[i][6144:] for s in seqs]) for i in range(4))
    cache.append(seq2, pos2, k, v)
    win = G.window if kind == "local" else None
    keys = sum(min(p + 1, win) if win else p + 1 for p in range(6144, 8192))
    ms = common.bench(lambda: cache.attend(seq2, pos2, q, gate), rep_ms=200)
    return dict(provider="opcontract", mode="prefill", layer=kind, B=B, cached=6144, new=2048,
                ms=ms[0], tflops=4.0 * B * G.hq * G.d * keys / ms[0] / 1e9)  # fmt: skip


def prefill_rows(G: Geometry) -> list[dict]:
    rows = []
    for B in (1, 8):
        for kind in ("global", "local"):
            rows.append(prefill_case(G, B, kind))
            print(rows[-1], flush=True)
    return rows


def decode_case(G: Geometry, B: int, L: int, copy: float, fa, rows: list) -> None:
    """One token per sequence against L cached positions (global layer): GPU time from
    graph replay; bandwidth = K and V bytes read / time, against the copy rate."""
    import torch.nn.functional as F

    from opcontract.backends.triton import gated_attention as tga

    g = torch.Generator(device=G.dev).manual_seed(B + L)
    k = torch.randn(B * L, G.hkv, G.d, device=G.dev, generator=g, dtype=G.dtype)
    v = torch.randn_like(k)
    q = torch.randn(B, G.hq, G.d, device=G.dev, generator=g, dtype=G.dtype)
    gate = torch.randn_like(q)
    ar = torch.arange(L // 128, device=G.dev)
    table = torch.arange(B, device=G.dev)[:, None] * L + 128 * ar[None]
    key_len = torch.full((B,), L, device=G.dev)
    pos, seq = key_len - 1, torch.arange(B, device=G.dev)
    out = torch.empty_like(q)
    attn = torch.empty(q.shape, dtype=torch.float32, device=G.dev)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=G.dev)
    provs = {}
    for split in (-1, 0, 1):
        plan = tga.plan_forward({"split": split}, q, k, pos, seq, table, layer="global",
                                window=None, scale=None)  # fmt: skip
        name = f"opcontract split={split} ({'split' if plan.split else 'fused'})"
        provs[name] = functools.partial(tga.run_forward, plan, q, k, v, gate, pos, table,
                                        key_len, out, attn, lse)  # fmt: skip
    k4, v4 = k.view(B, L, G.hkv, G.d), v.view(B, L, G.hkv, G.d)
    if fa:
        q4 = q.view(B, 1, G.hq, G.d)
        provs["fa4"] = lambda: _out(fa[0](q4, k4, v4, causal=True))
    qs = q.view(B, 1, G.hq, G.d).transpose(1, 2)
    ks, vs = k4.transpose(1, 2), v4.transpose(1, 2)
    provs["sdpa"] = lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)
    nbytes = 2 * B * L * G.hkv * G.d * 2
    for name, fn in provs.items():
        try:
            fn()
            try:
                ms, how = common.bench_graph(fn, rep_ms=100), "graph"
            except Exception:  # noqa: BLE001
                ms, how = common.bench(fn, rep_ms=100)[0], "eager"
            gbps = nbytes / ms / 1e6
            rows.append(dict(provider=name, mode="decode", B=B, L=L, ms=ms, timing=how,
                             gbps=gbps, of_copy=gbps / copy))  # fmt: skip
        except Exception as e:  # noqa: BLE001
            rows.append(dict(provider=name, mode="decode", B=B, L=L, error=repr(e)[:300]))
        print(rows[-1], flush=True)


def decode_rows(G: Geometry, Bs, Ls, copy: float) -> list[dict]:
    fa = _fa4()
    rows: list[dict] = []
    for L in Ls:
        for B in Bs:
            try:
                decode_case(G, B, L, copy, fa, rows)
                torch.cuda.empty_cache()
            except Exception as e:  # noqa: BLE001  (a CUDA fault is sticky: keep what ran)
                rows.append(dict(mode="decode", B=B, L=L, error=repr(e)[:300]))
                return rows
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="invariance,configs,peers,train,prefill,decode")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--note", default="", help="recorded in the JSON (e.g. the tree run)")
    a = ap.parse_args()
    if a.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    G = Geometry(a.tiny)
    parts = a.parts.split(",")
    payload = {"benchmark": "attention", "env": common.env_stamp(),
               "geometry": {"hq": G.hq, "hkv": G.hkv, "head_dim": G.d, "dtype": "bfloat16",
                            "window": G.window}}  # fmt: skip
    if a.note:
        payload["note"] = a.note
    if not a.tiny:
        payload["ceilings"] = {"matmul_tflops": common.matmul_tflops(),
                               "copy_gbps": common.copy_gbps()}  # fmt: skip

    def section(name, fn):
        t0 = time.time()
        try:
            payload[name] = fn()
        except Exception:  # noqa: BLE001
            payload[name] = {"error": traceback.format_exc()[-2000:]}
        payload.setdefault("seconds", {})[name] = round(time.time() - t0, 1)
        print(name, payload["seconds"][name], "s", flush=True)
        common.write(a.out, payload)

    L = 1000 if a.tiny else 16384
    steps = 6 if a.tiny else 64
    for part in parts:  # in the order given
        if part == "invariance":
            for kind in ("global", "local"):
                section(f"invariance_{kind}", lambda kind=kind: ours_invariance(G, kind, L, steps))
                section(
                    f"gradients_{kind}",
                    lambda kind=kind: ours_run_to_run_and_neighbours(
                        G, kind, 600 if a.tiny else 8192
                    ),
                )
                for B in (3,) if a.tiny else (1, 8, 64, 256):
                    top = 400 if a.tiny else {1: 16384, 8: 8192, 64: 4096, 256: 2048}[B]
                    section(
                        f"decode_batch_{kind}_{B}",
                        lambda kind=kind, B=B, top=top: ours_decode_batches(G, kind, B, top),
                    )
        elif part == "configs":
            section("configs", lambda: ours_configs(G))
        elif part == "peers":
            section("peer_invariance", lambda: peer_invariance(G, L, steps))
        elif part == "train" and not a.tiny:
            section("train", lambda: train_rows(G, (2048, 8192, 16384), 16384))
        elif part == "prefill" and not a.tiny:
            section("prefill", lambda: prefill_rows(G))
        elif part == "decode" and not a.tiny:
            section(
                "decode",
                lambda: decode_rows(
                    G, (1, 8, 64, 256), (2048, 8192, 32768), payload["ceilings"]["copy_gbps"]
                ),
            )
    common.write(a.out, payload)


if __name__ == "__main__":
    main()
