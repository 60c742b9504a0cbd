import torch


def head_inputs(T=6, H=96, V=600, dtype=torch.float32, seed=0, ignore=(1,)):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    t = torch.randint(0, V, (T,), generator=g)
    for i in ignore:
        if i < T:
            t[i] = -100
    return h, w, t


def run_impl(impl, config, **kw):
    """``impl`` with ``config`` forced, through dispatch (validated, differentiable)."""
    from opcontract import dispatch

    return dispatch.op(impl.op, backend=impl.name, config=config)(**kw)
