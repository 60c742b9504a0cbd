"""Check tensor-parallel invariance on this machine: one training step of the tiny random
Muse Glimmer (``integrations.tiny``) on 1 rank and on ``world`` gloo CPU processes, compared
bitwise (what the tests and ``benchmarks/tp_invariance_cpu.py`` run).

    from opcontract.parallel.selfcheck import run, step, mismatches
    one = step(None, torch.float32)
    ranks = run(2, "/tmp/tp", torch.float32)
    assert mismatches(ranks[0], one) == {}
"""

from __future__ import annotations

import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEP_LENGTHS = [7, 5, 9]  # a left-padded batch of mixed lengths, across the window of 4


def _full(g: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return g.full_tensor() if isinstance(g, DTensor) else g


def step(mesh, dtype: torch.dtype, *, shard: bool = True, vocab: int = 97, context: bool = False,
         lengths: list[int] | None = None, heads: int = 4, **kw) -> dict:  # fmt: skip
    """Log-probs, loss and every parameter's gradient of one training step of the tiny
    patched Muse Glimmer, sharded over ``mesh`` (None: one rank) when ``shard``: by tensor
    parallelism, or with ``context`` by context parallelism (``kw``: its ``combine``)."""
    from opcontract.integrations.tiny import left_padded, tiny_muse_glimmer
    from opcontract.integrations.transformers import (
        apply_opcontract,
        logprob_head,
        token_logprobs,
    )
    from opcontract.parallel import parallelize_muse_glimmer, provenance
    from opcontract.parallel.trace import activation_trace

    model = apply_opcontract(tiny_muse_glimmer(dtype, seed=0, vocab=vocab, heads=heads),
                             backend="torch")  # fmt: skip
    prov = None
    if shard and context:
        from opcontract.parallel import context as cp

        cp.context_parallel_muse_glimmer(model, mesh, **kw)
        prov = cp.provenance(model)
    elif shard:
        parallelize_muse_glimmer(model, mesh, **kw)
        prov = provenance(model)
    ids, mask = left_padded(lengths or STEP_LENGTHS, vocab=vocab)
    labels = ids.masked_fill(mask == 0, -100)
    t0 = time.perf_counter()
    with activation_trace(model) as trace:
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    lp = token_logprobs(model, ids, mask)
    ramp = torch.linspace(-1.0, 1.0, lp.numel()).reshape(lp.shape)
    (loss + (lp * ramp).sum()).backward()
    seconds = time.perf_counter() - t0
    with torch.no_grad():  # the trainer's other head outputs (TRL's entropy and is_top1)
        hidden = model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        rows = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        head = logprob_head(model, rows, ids[:, 1:].reshape(-1), entropy=True, predicted=True)
    grads = {
        n: _full(p.grad).detach().clone() for n, p in model.named_parameters() if p.grad is not None
    }
    local = {  # what this rank holds of four sharded weights
        n: tuple(p.to_local().shape if hasattr(p, "to_local") else p.shape)
        for n, p in model.named_parameters()
        if n.endswith(("layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
                       "layers.0.mlp.down_proj.weight", "embed_tokens.weight", "lm_head.weight"))
    }  # fmt: skip
    return dict(loss=loss.detach(), logprobs=lp.detach(), entropy=head.entropy,
                predicted=head.predicted, grads=grads, provenance=prov, local_shapes=local,
                seconds=seconds, trace=trace)  # fmt: skip


def rollout(mesh, dtype: torch.dtype, *, new_tokens: int = 6, vocab: int = 97,
            cache_implementation: str | None = None, **kw) -> dict:  # fmt: skip
    """Greedy ``generate_with_logprobs`` of the tiny patched model sharded over ``mesh`` (None:
    one rank), with generate()'s ``cache_implementation``, and a training forward's log-probs
    of the same completions."""
    from opcontract.integrations.tiny import left_padded, tiny_muse_glimmer
    from opcontract.integrations.transformers import (
        apply_opcontract,
        generate_with_logprobs,
        token_logprobs,
    )
    from opcontract.parallel import parallelize_muse_glimmer

    model = apply_opcontract(tiny_muse_glimmer(dtype, seed=0, vocab=vocab), backend="torch")
    parallelize_muse_glimmer(model, mesh, **kw)
    ids, mask = left_padded(STEP_LENGTHS, vocab=vocab)
    ro = generate_with_logprobs(model, ids, mask, max_new_tokens=new_tokens, do_sample=False,
                                cache_implementation=cache_implementation)  # fmt: skip
    with torch.no_grad():
        train = token_logprobs(model, ro.sequences, ro.attention_mask)[:, ids.shape[1] - 1 :]
    return dict(sequences=ro.sequences, rollout=ro.logprobs, train=train)


def worker(rank: int, world: int, init: str, out: str, dtype: torch.dtype, kw: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)  # ``world`` processes share the machine's cores
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        if kw.pop("fake_version_rank", None) == rank:  # a rank that runs other code
            import opcontract

            opcontract.__version__ += "+other"
        what = {"step": step, "rollout": rollout}[kw.pop("what", "step")]
        try:
            result = what(mesh, dtype, **kw)
        except Exception as e:  # every rank reports, so the parent sees each rank's error
            result = dict(error=f"{type(e).__name__}: {e}")
        torch.save(result, f"{out}.{rank}")
        dist.barrier()  # no rank tears its connections down while a peer still uses them
    finally:
        dist.destroy_process_group()
    # The result is on disk. Leave without running static destructors: gloo's at-exit teardown
    # aborted one CPU worker of four (SIGABRT, "terminate called without an active exception")
    # after its work was done; the parent reads every rank's result file and checks those.
    os._exit(0)


def run(world: int, workdir: str | None = None, dtype: torch.dtype = torch.float32, **kw) -> list:
    """``step`` on ``world`` spawned gloo processes (``kw``: ``parallelize_muse_glimmer``'s);
    each rank's result, or its error as ``{"error": ...}``."""
    with tempfile.TemporaryDirectory(dir=workdir) as d:
        init, out = os.path.join(d, "init"), os.path.join(d, "out")
        mp.spawn(worker, args=(world, init, out, dtype, kw), nprocs=world, join=True)
        return [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]


def mismatches(a: dict, b: dict) -> dict[str, int]:
    """Elements that differ between two ``step`` results, per tensor (absent: equal): loss,
    log-probs, entropy, argmax and every gradient."""
    out = {}
    for key in ("loss", "logprobs", "entropy", "predicted"):
        if key not in a or key not in b:  # results saved before these were recorded
            continue
        if not torch.equal(a[key], b[key]):
            out[key] = int((a[key] != b[key]).sum())
    if a["grads"].keys() != b["grads"].keys():
        raise ValueError("the two steps have gradients for different parameters")
    for n in a["grads"]:
        if not torch.equal(a["grads"][n], b["grads"][n]):
            out[n] = int((a["grads"][n] != b["grads"][n]).sum())
    return out
