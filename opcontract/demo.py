"""The main job (``make demo``).

First the point, on a tiny random Muse Glimmer in Hugging Face transformers (when the
``[hf]`` extra is installed): sample completions for a left-padded batch with ``generate()``
and count the tokens whose rollout log-prob differs from the trainer's (TRL 1.16's
``fused_lm_head=True``) for the same sequences: the stock model, then the model patched by
``apply_opcontract``. Then the ops: lint the contracts, run every op through dispatch on the
available device, print what was selected, what was rejected and why, and check accuracy
against the float64 oracle and bitwise invariance.

``python -m opcontract.demo [--only hf|ops]``. On a machine without a GPU, Triton kernels run
under the interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from opcontract import ContractViolation, NoBackendError, dispatch  # noqa: E402
from opcontract.backends.registry import implementations  # noqa: E402
from opcontract.cli import lint  # noqa: E402
from opcontract.conformance import (  # noqa: E402
    check_accuracy,
    check_batch_invariance,
    check_run_to_run,
    make_inputs,
    runner_for,
)
from opcontract.contracts import load_all  # noqa: E402


def _section(title: str) -> None:
    print(f"\n== {title} " + "=" * max(0, 70 - len(title)))


HF_LENGTHS, HF_NEW = (3, 9, 5, 12), 12


def muse_glimmer_train_rollout() -> int:
    """The stock and the patched tiny model: rollout log-probs against the trainer's."""
    _section("Muse Glimmer in transformers: rollout log-probs against TRL's trainer")
    missing = [m for m in ("transformers", "trl") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"skipped: {', '.join(missing)} not installed (pip install \"opcontract[hf]\")")
        return 0
    import transformers
    import trl

    from opcontract.integrations.parity import train_rollout_mismatches

    print(
        f"transformers {transformers.__version__}, trl {trl.__version__}; a tiny random "
        f"MuseGlimmerForConditionalGeneration (4 layers: 3 sliding with a window of 4, 1 "
        f"global);\n{len(HF_LENGTHS)} left-padded prompts of {'/'.join(map(str, HF_LENGTHS))} "
        f"tokens, {HF_NEW} sampled tokens each through generate(). Each token's log-prob as the "
        f"rollout\nrecords it, against the trainer's (model(..., labels, fused_lm_head=True)) "
        f"over the finished sequences:"
    )
    failures = 0
    for patched in (False, True):
        for dtype in (torch.float32, torch.bfloat16):
            r = train_rollout_mismatches(dtype, patched=patched, trainer_head="trl",
                                         lengths=HF_LENGTHS, new_tokens=HF_NEW)  # fmt: skip
            how = ("patched (apply_opcontract, integrations.trl)" if patched
                   else "stock (DynamicCache, sdpa; TRL's chunked head)")  # fmt: skip
            print(f"  {how:46s} {r['dtype']:9s} {r['differ']:3d} of {r['tokens']} tokens "
                  f"differ (max {r['max_abs_diff']:.1e})")  # fmt: skip
            failures += patched and r["differ"] > 0
    return failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m opcontract.demo")
    ap.add_argument("--only", choices=["hf", "ops"], help="run one part")
    only = ap.parse_args(argv).only
    failures = 0 if only == "ops" else muse_glimmer_train_rollout()
    if only == "hf":
        print(f"\n{'all checks passed' if not failures else f'{failures} check(s) FAILED'}")
        return 1 if failures else 0
    return ops(failures)


def ops(failures: int = 0) -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16"
    _section("contract-lint")
    if lint.main([]) != 0:
        return 1
    for op, contract in load_all().items():
        case = contract.conformance.cases[0]
        inputs, params = make_inputs(contract, case, dtype, device=device, seed=1)
        _section(f"{op} on {device}, {dtype}, {case.sizes}, {case.params}")
        print(dispatch.explain(op, **inputs, **params))
        out = dispatch.op(op)(**inputs, **params)
        print("provenance:", dispatch.last_provenance().as_dict())
        first = out if isinstance(out, torch.Tensor) else out[0]
        print(
            f"output: {type(out).__name__} {list(first.shape)} {first.dtype}, "
            f"first values {first.flatten()[:4].tolist()}"
        )
        for impl in implementations(op):
            if impl.relaxed_only:
                continue
            run = runner_for(impl)
            try:
                checks = [
                    check_accuracy(run, contract, case, dtype, device=device),
                    check_run_to_run(run, contract, case, dtype, device=device),
                    check_batch_invariance(run, contract, case, dtype, device=device),
                ]
            except NoBackendError as e:
                print(f"  {impl.name}: not run here: {e.rejected[impl.name]}")
                continue
            for r in checks:
                failures += not r.ok
                print(f"  {impl.name:14s} {r.check:10s} {'ok  ' if r.ok else 'FAIL'} {r.detail}")

    _section("fail closed")
    contract = load_all()["softcap_logprob"]
    inputs, params = make_inputs(contract, contract.conformance.cases[0], dtype, device=device)
    try:
        dispatch.op("softcap_logprob")(**inputs, softcap=-1.0)
    except ContractViolation as e:
        print("ContractViolation:", e)
    try:
        dispatch.op("softcap_logprob", backend="torch.eager")(**inputs, **params)
    except NoBackendError as e:
        print("NoBackendError:", e)
    print(f"\n{'all checks passed' if not failures else f'{failures} check(s) FAILED'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
