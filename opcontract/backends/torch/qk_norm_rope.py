"""qk_norm_rope in plain torch: the float64 oracle and the strict path (elementwise float32,
the row's square sum the fixed tree of rms_norm, the rotation's products and sums as the
contract writes them, one rounding)."""

from __future__ import annotations

import torch

from opcontract.backends.fixed_order import tree_sum
from opcontract.backends.placement import on_device
from opcontract.backends.qk_norm_rope import cos_sin, inv_freq


def reference(q, k, positions, *, layer, rope_theta=None, qk_scale=3.87, eps=1e-5):
    """Float64 oracle (differentiable): QKOutput(q_out, k_out) in float64."""
    from opcontract.outputs import QKOutput

    def one(x, scale):
        x = x.double()
        n = x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + eps) * scale
        if layer == "global":
            return n
        half = x.shape[-1] // 2
        a = positions.double()[:, None] * inv_freq(rope_theta, x.shape[-1], x.device)[None, :]
        c, s = torch.cos(a)[:, None, :], torch.sin(a)[:, None, :]
        lo, hi = n[..., :half], n[..., half:]
        return torch.cat([lo * c - hi * s, hi * c + lo * s], dim=-1)

    return QKOutput(one(q, qk_scale), one(k, 1.0))


def _rotate(n, c, s):
    half = n.shape[-1] // 2
    lo, hi = n[..., :half], n[..., half:]
    return torch.cat([lo * c - hi * s, hi * c + lo * s], dim=-1)


def _unrotate(g, c, s):
    half = g.shape[-1] // 2
    lo, hi = g[..., :half], g[..., half:]
    return torch.cat([lo * c + hi * s, hi * c - lo * s], dim=-1)


def _norm(x, eps):
    x32 = x.float()
    rstd = 1.0 / torch.sqrt(tree_sum(x32 * x32) / x.shape[-1] + eps)
    return x32, rstd


def _trig(positions, layer, rope_theta, dim):
    if layer == "global":
        return None
    c, s = cos_sin(positions, rope_theta, dim)
    return c[:, None, :], s[:, None, :]


def forward(config, q, k, positions, *, layer, rope_theta, qk_scale, eps):
    """(q_out, k_out, rstd_q, rstd_k)."""
    trig = _trig(on_device(positions, q.device), layer, rope_theta, q.shape[-1])
    outs, rstds = [], []
    for x, scale in ((q, qk_scale), (k, None)):
        x32, rstd = _norm(x, eps)
        n = x32 * rstd[..., None]
        if scale is not None:
            n = n * torch.tensor(scale, dtype=torch.float32)
        if trig is not None:
            n = _rotate(n, *trig)
        outs.append(n.to(x.dtype))
        rstds.append(rstd)
    return (*outs, *rstds)


def backward(config, saved, grads, needs, *, layer, rope_theta, qk_scale, eps):
    q = saved["q"]
    trig = _trig(on_device(saved["positions"], q.device), layer, rope_theta, q.shape[-1])
    out = {}
    for name, scale in (("q", qk_scale), ("k", None)):
        x, rstd, g = saved[name], saved[f"rstd_{name}"], grads[f"{name}_out"]
        if not needs[name]:
            out[name] = None
            continue
        if g is None:
            g = torch.zeros_like(x)
        g32 = g.float()
        if trig is not None:
            g32 = _unrotate(g32, *trig)
        if scale is not None:
            g32 = g32 * torch.tensor(scale, dtype=torch.float32)
        xhat = x.float() * rstd[..., None]
        dx = rstd[..., None] * (g32 - xhat * (tree_sum(g32 * xhat) / x.shape[-1])[..., None])
        out[name] = dx.to(x.dtype)
    return out
