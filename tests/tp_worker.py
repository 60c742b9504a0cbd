"""What every rank of the tensor-parallel tests runs (a module, so spawn can pickle it)."""

from __future__ import annotations

import torch
import torch.distributed as dist

STEP_LENGTHS = [7, 5, 9]  # a left-padded batch of mixed lengths, across the window of 4


def _full(g: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return g.full_tensor() if isinstance(g, DTensor) else g


def step(mesh, dtype: torch.dtype, *, shard: bool = True, **kw) -> dict:
    """Log-probs, loss and every parameter's gradient of one training step of the tiny
    patched Muse Glimmer, sharded over ``mesh`` (None: one rank) when ``shard``."""
    from opcontract.integrations.tiny import left_padded, tiny_muse_glimmer
    from opcontract.integrations.transformers import apply_opcontract, token_logprobs
    from opcontract.parallel import parallelize_muse_glimmer, provenance

    model = apply_opcontract(tiny_muse_glimmer(dtype, seed=0), backend="torch")
    prov = None
    if shard:
        parallelize_muse_glimmer(model, mesh, **kw)
        prov = provenance(model)
    ids, mask = left_padded(STEP_LENGTHS)
    labels = ids.masked_fill(mask == 0, -100)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    lp = token_logprobs(model, ids, mask)
    ramp = torch.linspace(-1.0, 1.0, lp.numel()).reshape(lp.shape)
    (loss + (lp * ramp).sum()).backward()
    grads = {
        n: _full(p.grad).detach().clone() for n, p in model.named_parameters() if p.grad is not None
    }
    return dict(loss=loss.detach(), logprobs=lp.detach(), grads=grads, provenance=prov)


def worker(rank: int, world: int, init: str, out: str, dtype: torch.dtype, kw: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        if kw.pop("fake_version_rank", None) == rank:  # a rank that runs other code
            import opcontract

            opcontract.__version__ += "+other"
        try:
            result = step(mesh, dtype, **kw)
        except Exception as e:  # every rank reports, so the parent sees each rank's error
            result = dict(error=f"{type(e).__name__}: {e}")
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()
