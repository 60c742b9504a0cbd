"""How fast a CuTe DSL chunk program streams its keys and values: split decode's grid (one
program per sequence, 512-position chunk and KV head, as ``_attn_chunk_kernel``'s), each program
reading its chunk's four K and V blocks of 128 positions x 128 channels through TMA into a
ring of shared-memory stages (one producer warp issues, one consumer warpgroup waits on each
stage, touches it and frees it; no products). The CuTe counterpart of the ``read`` rung of
``attention_decode_ceiling.py`` (Triton: 7.26 / 24.6 / 174 us at B = 1 / 8 / 64, L = 8192 on
an H100, ``attention_decode_ceiling_h100.json``): whether TMA and a producer warp stream a
chunk faster than Triton's pointer loads, which bounds split decode at B = 1 (issue 17).

    python benchmarks/attention_decode_cute_loads.py --out results.json [--B 1,8,64] \
        [--L 8192,32768] [--stages 2,3,4]
    python benchmarks/attention_decode_cute_loads.py --compile-only   # no GPU: CUTE_DSL_ARCH

Each sequence's cache is contiguous (rows s * L .. s * L + L - 1 of a [B * L, 2 * 128] K and V);
the copy rate is measured in the same run. GPU time per call from the profiler
(``common.kernel_us``, as the Triton ladder).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HKV, D, BLOCK, CHUNK_BLOCKS = 2, 128, 128, 4


def _kernel_class():
    global cutlass, cute, pipeline, utils, sm90_utils  # the kernel's annotations resolve here
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils as utils
    import cutlass.utils.hopper_helpers as sm90_utils

    class ChunkStream:
        """Program (s * NC + i, h): chunk i of sequence s, KV head h; ``stages`` K+V stages."""

        def __init__(self, stages: int):
            self.stages = stages
            self.threads = 2 * 128  # warpgroup 0: the producer warp (and idle warps); 1: consumers

        @cute.jit
        def __call__(self, k: cute.Tensor, v: cute.Tensor, out: cute.Tensor,
                     n_chunks: cutlass.Int32, stream):
            dtype = k.element_type
            tile = (BLOCK, D, D)  # (rows, -, channels): a block as an MMA A-operand tile
            self.smem_staged = sm90_utils.make_smem_layout_a(
                utils.LayoutEnum.ROW_MAJOR, tile, dtype, self.stages)
            one = cute.slice_(self.smem_staged, (None, None, 0))
            g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
            tma_k, tma_tk = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, k, one, (BLOCK, D))
            tma_v, tma_tv = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, v, one, (BLOCK, D))
            self.stage_bytes = 2 * cute.size_in_bytes(dtype, one)

            @cute.struct
            class Storage:
                mbar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
                sK: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(self.smem_staged)],
                                      1024]
                sV: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(self.smem_staged)],
                                      1024]

            self.storage = Storage
            rows = cute.size(k, mode=[0])
            grid = rows // (BLOCK * CHUNK_BLOCKS)
            self.kernel(tma_k, tma_tk, tma_v, tma_tv, out, self.smem_staged).launch(
                grid=[grid, HKV, 1], block=[self.threads, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, tma_k: cute.CopyAtom, mK: cute.Tensor, tma_v: cute.CopyAtom,
                   mV: cute.Tensor, out: cute.Tensor, smem_staged: cute.ComposedLayout):
            tidx, _, _ = cute.arch.thread_idx()
            chunk, kvh, _ = cute.arch.block_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            wg = cute.arch.make_warp_uniform(tidx // 128)
            if warp == 0:
                cute.nvgpu.cpasync.prefetch_descriptor(tma_k)
                cute.nvgpu.cpasync.prefetch_descriptor(tma_v)
            smem = utils.SmemAllocator()
            storage = smem.allocate(self.storage)
            pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar.data_ptr(), num_stages=self.stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4),
                tx_count=self.stage_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
                defer_sync=True)
            pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
            sK = storage.sK.get_tensor(smem_staged.outer, swizzle=smem_staged.inner)
            sV = storage.sV.get_tensor(smem_staged.outer, swizzle=smem_staged.inner)
            gK = cute.local_tile(mK, (BLOCK, D), (None, None))  # (128, 128, row blocks, heads)
            gV = cute.local_tile(mV, (BLOCK, D), (None, None))
            tKs, tKg = cute.nvgpu.cpasync.tma_partition(
                tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2),
                cute.group_modes(gK, 0, 2))
            tVs, tVg = cute.nvgpu.cpasync.tma_partition(
                tma_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2),
                cute.group_modes(gV, 0, 2))
            pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))
            if warp == 0:  # the producer: the chunk's four blocks, K and V a stage
                prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                    self.stages)
                for j in range(CHUNK_BLOCKS):
                    pipe.producer_acquire(prod)
                    bar = pipe.producer_get_barrier(prod)
                    blk = chunk * CHUNK_BLOCKS + j
                    cute.copy(tma_k, tKg[(None, blk, kvh)], tKs[(None, prod.index)],
                              tma_bar_ptr=bar)
                    cute.copy(tma_v, tVg[(None, blk, kvh)], tVs[(None, prod.index)],
                              tma_bar_ptr=bar)
                    pipe.producer_commit(prod)
                    prod.advance()
                pipe.producer_tail(prod)
            if wg == 1:  # the consumers: wait on each stage, touch it, free it
                ctid = tidx - 128
                cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                    self.stages)
                acc = cutlass.Float32(0.0)
                for _j in range(CHUNK_BLOCKS):
                    pipe.consumer_wait(cons)
                    acc += sK[(ctid, 0, cons.index)].to(cutlass.Float32)
                    acc += sV[(ctid, ctid, cons.index)].to(cutlass.Float32)
                    pipe.consumer_release(cons)
                    cons.advance()
                if ctid == 0:
                    out[chunk * HKV + kvh] = acc

    return ChunkStream


def compile_stream(stages: int):
    """The kernel compiled for TVM FFI's stand-ins (k, v [rows, 256] bf16, out float32)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    kv = make_fake_tensor(cutlass.BFloat16, (cute.sym_int64(divisibility=BLOCK * CHUNK_BLOCKS),
                                             HKV * D), (HKV * D, 1), assumed_align=16)
    out = make_fake_tensor(cutlass.Float32, (cute.sym_int64(),), (1,), assumed_align=4)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    kernel = _kernel_class()(stages)
    return cute.compile(kernel, kv, kv, out, cutlass.Int32(1), stream,
                        options="--enable-tvm-ffi")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--B", default="1,8,64")
    ap.add_argument("--L", default="8192,32768")
    ap.add_argument("--stages", default="2,3,4")
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90a, no GPU")
    a = ap.parse_args()
    if a.compile_only:
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
        for st in map(int, a.stages.split(",")):
            print("stages", st, type(compile_stream(st)).__name__)
        return
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import common

    copy = common.copy_gbps()
    rows: list = []
    payload = {"benchmark": "attention_decode_cute_loads", "env": common.env_stamp(),
               "command": " ".join(["python", *sys.argv]), "ceilings": {"copy_gbps": copy},
               "rows": rows}
    fns = {st: compile_stream(st) for st in map(int, a.stages.split(","))}
    for L in map(int, a.L.split(",")):
        for B in map(int, a.B.split(",")):
            k = torch.randn(B * L, HKV * D, device="cuda").bfloat16()
            v = torch.randn(B * L, HKV * D, device="cuda").bfloat16()
            nc = B * L // (BLOCK * CHUNK_BLOCKS)
            out = torch.empty(nc * HKV, device="cuda")
            nbytes = 2 * k.numel() * k.element_size()
            for st, fn in fns.items():
                call = lambda fn=fn, k=k, v=v, out=out, nc=nc: fn(k, v, out, nc)  # noqa: E731
                call()
                us = sum(common.kernel_us(call, calls=20).values())
                row = dict(B=B, L=L, programs=nc * HKV, stages=st, kernel_us=round(us, 2),
                           of_copy=nbytes / us / 1e3 / copy, finite=bool(out.isfinite().all()))
                rows.append(row)
                print(row, flush=True)
            del k, v
            torch.cuda.empty_cache()
    if a.out:
        common.write(a.out, payload)


if __name__ == "__main__":
    main()
