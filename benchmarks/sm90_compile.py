"""The Triton gated_attention kernels compiled for sm_90 on any machine (Triton compiles for
the target it is told; no GPU needed), as a real launch at Muse Glimmer's geometry gets them:
bf16, head_dim 128, the launch's 16-byte divisibility hints (pointers, Hq, G, D, window).

Call it in a process without ``TRITON_INTERPRET=1`` (under the interpreter the kernels are
interpreter functions, which don't compile). It imports ``opcontract`` from ``sys.path``, so
a caller may put another checkout first (``kernel_resources.py --tree``).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

P, F, I32 = "*bf16", "*fp32", "*i32"
_INDEX = dict(positions_ptr=I32, block_rows_ptr=I32, key_len_ptr=I32, tile_ptr=I32)
_SIZES = dict(T="i32", N="i32", Hq="i32", Hkv="i32", G="i32", D="i32", NB="i32")
SIGNATURES = {
    "_attn_chunk_kernel": dict(q_ptr=P, k_ptr=P, v_ptr=P, **_INDEX, part_m_ptr=F, part_l_ptr=F,
                               part_o_ptr=F, gate_ptr=P, out_ptr=P, attn_ptr=F, lse_ptr=F,
                               count_ptr=I32, **_SIZES, NC="i32", window="i32", c="fp32"),
    "_attn_fwd_kernel": dict(q_ptr=P, k_ptr=P, v_ptr=P, gate_ptr=P, **_INDEX, out_ptr=P,
                             attn_ptr=F, lse_ptr=F, go_ptr=I32, redo_ptr=I32, **_SIZES,
                             window="i32", c="fp32"),
    "_attn_merge_kernel": dict(gate_ptr=P, positions_ptr=I32, key_len_ptr=I32, tile_ptr=I32,
                               part_m_ptr=F, part_l_ptr=F, part_o_ptr=F, out_ptr=P, attn_ptr=F,
                               lse_ptr=F, T="i32", Hq="i32", Hkv="i32", G="i32", D="i32",
                               NC="i32", window="i32"),
    "_attn_bwd_dq_kernel": dict(q_ptr=P, k_ptr=P, v_ptr=P, da_ptr=P, delta_ptr=F, lse_ptr=F,
                                **_INDEX, dq_ptr=P, **_SIZES, window="i32", c="fp32",
                                scale="fp32"),
    "_attn_bwd_dkv_kernel": dict(q_ptr=P, k_ptr=P, v_ptr=P, da_ptr=P, delta_ptr=F, lse_ptr=F,
                                 block_rows_ptr=I32, key_len_ptr=I32, qrow_ptr=I32, dk_ptr=P,
                                 dv_ptr=P, N="i32", Hq="i32", Hkv="i32", G="i32", D="i32",
                                 NB="i32", window="i32", c="fp32", scale="fp32"),
}  # fmt: skip
BASE = dict(LOCAL=False, INTERPRET=False, IEEE=False, BLOCK=128, BLOCK_D=128, CHUNK_BLOCKS=4)
_HINTED_INTS = ("Hq", "G", "D", "window")  # multiples of 16 at Muse Glimmer's geometry


def compile_attention(kernel: str, constexprs: dict, num_warps: int, num_stages: int,
                      maxnreg: int | None = None) -> Any:
    """(compiled kernel, every constexpr it was compiled with): ``kernel`` of
    ``gated_attention_kernels`` with BASE's constexprs, ``constexprs`` over them, the rest at
    their defaults."""
    mod = importlib.import_module("opcontract.backends.triton.gated_attention_kernels")
    fn = getattr(mod, kernel)
    sig = dict(SIGNATURES[kernel])
    consts = {**BASE, **constexprs}
    for name, p in inspect.signature(fn.fn).parameters.items():
        if name not in sig and name not in consts:
            if p.default is inspect.Parameter.empty:
                raise ValueError(f"{kernel}: constexpr {name} has no default; pass it")
            consts[name] = p.default
    consts = {n: v for n, v in consts.items() if n in fn.arg_names}  # BASE's the kernel takes
    options = dict(num_warps=num_warps, num_stages=num_stages)
    if maxnreg:
        options["maxnreg"] = maxnreg  # ptxas's register cap (spills what does not fit)
    return _compile(fn, sig, consts, _HINTED_INTS, options), consts


def _compile(fn, sig: dict, consts: dict, hinted, options: dict) -> Any:
    """``fn`` compiled for sm_90: ``sig`` types its runtime arguments (the rest are
    constexprs, valued by ``consts``), 16-byte divisibility hints on the pointers and the
    ``hinted`` integers."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    sig = {**{n: "constexpr" for n in fn.arg_names}, **sig}
    marked = [n for n, t in sig.items() if t.startswith("*") or n in hinted]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in marked}
    src = ASTSource(fn, sig, {(fn.arg_names.index(n),): v for n, v in consts.items()}, attrs)
    return compile(src, target=GPUTarget("cuda", 90, 32), options=options)


_B, _F, _I64 = "*bf16", "*fp32", "*i64"
_G_OUT = dict(t_ptr=_I64, lse_ptr=_F, meanz_ptr=_F, gl_ptr=_F, ge_ptr=_F, gs_ptr=_F, g_ptr=_B)
HEAD_SIGNATURES = {
    "_grad_logits_kernel": dict(h_ptr=_B, w_ptr=_B, **_G_OUT, T="i32", V="i32", H="i32",
                                stride_h="i32", stride_w="i32", stride_g="i32", v_first="i32",
                                n_cols="i32", scale="fp32", softcap="fp32", multiplier="fp32",
                                ignore_index="i32", zero="fp32"),
    "_grad_logits_from_acc_kernel": dict(acc_ptr=_F, stride_acc="i32", **_G_OUT, T="i32",
                                         V="i32", stride_g="i32", v_first="i32", n_cols="i32",
                                         g_first="i32", scale="fp32", softcap="fp32",
                                         multiplier="fp32", ignore_index="i32"),
}  # fmt: skip


def compile_head(kernel: str, constexprs: dict, hinted: tuple = (), num_warps: int = 8,
                 num_stages: int = 3) -> Any:  # fmt: skip
    """``kernel`` of ``softcap_logprob_kernels`` for sm_90 (bf16 inputs), with the fp-fusion
    option launches use, 16-byte divisibility hints on the pointers and on the ``hinted``
    integer arguments (as a launch with such values gets them)."""
    from opcontract.backends.triton import LAUNCH

    mod = importlib.import_module("opcontract.backends.triton.softcap_logprob_kernels")
    fn = getattr(mod, kernel)
    options = dict(num_warps=num_warps, num_stages=num_stages, **LAUNCH)
    return _compile(fn, HEAD_SIGNATURES[kernel], constexprs, hinted, options)
