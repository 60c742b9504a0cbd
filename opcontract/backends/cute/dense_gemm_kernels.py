"""CuTe DSL kernel of dense_gemm for SM90: c = a @ b.T (+ bias), K in promoted 256-element
partials. Device code only; the host side (shapes, padding, compile cache) is dense_gemm.py.

Numerics, per output element (the contract's gemm_k, the same as the Triton kernel's):
K is cut into 256-element chunks, ascending. Each chunk's 16 WGMMA k16 instructions (4 k-tiles
of 64) accumulate, in ascending k, into a float32 partial that starts from zeros held in
registers (accumulate flag set, like Triton's unfoldable zeros); the partial is then added to
the running float32 total with one IEEE add (the total starts at +0). After the last chunk the
bias is added in float32, and the sum is cast once to the output dtype (round to nearest even).
Two epilogues read a float32 [M, N] ``addend`` (the LM head's backward sums): "add" adds it
after the last chunk, c = addend + total (the Triton kernel's ACCUMULATE); "seed" starts the
running total from it instead of +0, ((addend + p_0) + p_1) + ... (Triton's SEEDED), so that
calls over consecutive K ranges cut on 256-element chunks give one call's bits. The output
may be float32 (no rounding) or the 16-bit input dtype.
(ptxas folds the literal zeros of each tile's first chunk into that chunk's first instruction,
SASS `HGMMA ... RZ, !UPT`, i.e. D = A.B without C; later chunks read the zeroed registers.
A.B and A.B + (+0) can differ only in the sign of an exactly-zero partial, which the +0 total
absorbs (+0 + -0 = +0), so no bit moves.)
Tile sizes along M and N and the tile order move no bits: every element sees the same
instruction sequence; rows beyond M, columns beyond N and k beyond K are TMA's zero fill.
``overlap`` (for K a multiple of 512) keeps two partials, so that a chunk's partial is added to
the total while the next chunk's WGMMAs run instead of after draining them: the same
instructions on the same values, in the same order, so the same bits.

Layout: one producer warp (TMA loads of a and b tiles into a multi-stage mbarrier ring) and one
or two consumer warpgroups (WGMMA, promotion, epilogue: registers -> shared -> TMA store). The
grid is persistent: CTA i serves tiles i, i + grid, ... in a grouped order.

Requirements the host guarantees: a [M, K], b [N, K], c [M, N] row-major with K % 8 == 0,
N % 8 == 0 and 16-byte aligned base pointers (TMA); bias [>= N] contiguous when present.
"""

# fmt: off
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils

CHUNK_K = 256   # the contract's gemm_k block
TILE_K = 64     # one pipeline stage along K: 4 WGMMA k16 instructions
PROMOTE = CHUNK_K // TILE_K
ADDEND_MODES = ("none", "add", "seed")


class PromotedGemmSm90:
    """A warp-specialised persistent GEMM with per-256-k float32 promotion (see module doc).

    ``tile_m`` is 64 (one consumer warpgroup) or 128 (two, each 64 rows); ``tile_n`` is
    64 or 128 (a consumer thread then holds two float32 accumulators of tile_n / 2 values).
    """

    def __init__(self, tile_m: int, tile_n: int, has_bias: bool, group_m: int = 8,
                 overlap: bool = False, addend: str = "none"):
        if tile_m not in (64, 128):
            raise ValueError(f"tile_m must be 64 or 128, got {tile_m}")
        if tile_n not in (64, 128):
            raise ValueError(f"tile_n must be 64 or 128, got {tile_n}")
        if addend not in ADDEND_MODES:
            raise ValueError(f"addend must be one of {ADDEND_MODES}, got {addend!r}")
        if addend != "none" and has_bias:
            raise ValueError("an addend epilogue takes no bias")
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.has_bias = has_bias
        self.addend = addend
        self.group_m = group_m
        self.overlap = overlap
        self.acc_dtype = cutlass.Float32
        self.atom_layout_mnk = (tile_m // 64, 1, 1)
        self.num_mma_warp_groups = tile_m // 64
        self.threads_per_wg = 128
        self.num_mma_threads = self.num_mma_warp_groups * self.threads_per_wg
        self.threads_per_cta = (1 + self.num_mma_warp_groups) * self.threads_per_wg
        self.producer_regs = 40
        self.consumer_regs = 232
        self.epi_stage = 4
        self.buffer_align_bytes = 1024
        self.smem_capacity = utils.get_smem_capacity_in_bytes("sm_90")
        # named barrier 1: the consumer warpgroups' epilogue (0 is __syncthreads)
        self.epi_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=self.num_mma_threads)

    def _setup(self) -> None:
        self.tile_mnk = (self.tile_m, self.tile_n, TILE_K)
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype,
            self.a_layout.sm90_mma_major_mode(), self.b_layout.sm90_mma_major_mode(),
            self.acc_dtype, self.atom_layout_mnk, tiler_mn=(64, self.tile_n),
        )
        self.epi_tile = sm90_utils.compute_tile_shape_or_override(
            self.tile_mnk, self.c_dtype, is_cooperative=self.num_mma_warp_groups == 2,
        )
        ab_bytes = (self.tile_m + self.tile_n) * TILE_K * self.ab_dtype.width // 8
        epi_bytes = self.epi_tile[0] * self.epi_tile[1] * self.c_dtype.width // 8 * self.epi_stage
        # 3 alignment pads of 1 KiB (mbarriers, sA, sB, sD) kept free
        self.ab_stage = min(8, (self.smem_capacity - 4 * 1024 - epi_bytes) // ab_bytes)
        self.a_smem_staged = sm90_utils.make_smem_layout_a(
            self.a_layout, self.tile_mnk, self.ab_dtype, self.ab_stage)
        self.b_smem_staged = sm90_utils.make_smem_layout_b(
            self.b_layout, self.tile_mnk, self.ab_dtype, self.ab_stage)
        self.epi_smem_staged = sm90_utils.make_smem_layout_epi(
            self.c_dtype, self.c_layout, self.epi_tile, self.epi_stage)

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, bias: cute.Tensor,
                 addend: cute.Tensor, num_ctas: cutlass.Int32, stream: cuda.CUstream):
        """Launch on ``stream``: c[M, N] = a[M, K] @ b[N, K].T (+ bias[:N]; or with the
        float32 addend[M, N] added or as the seed), ``num_ctas`` persistent CTAs (at most the
        tile count)."""
        self.ab_dtype = a.element_type
        self.c_dtype = c.element_type
        self.a_layout = utils.LayoutEnum.from_tensor(a)
        self.b_layout = utils.LayoutEnum.from_tensor(b)
        self.c_layout = utils.LayoutEnum.from_tensor(c)
        self._setup()

        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        tma_a, tma_ta = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, a, cute.slice_(self.a_smem_staged, (None, None, 0)), (self.tile_m, TILE_K))
        tma_b, tma_tb = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, b, cute.slice_(self.b_smem_staged, (None, None, 0)), (self.tile_n, TILE_K))
        tma_c, tma_tc = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), c,
            cute.slice_(self.epi_smem_staged, (None, None, 0)), self.epi_tile)

        @cute.struct
        class Storage:
            ab_mbar: cute.struct.MemRange[cutlass.Int64, self.ab_stage * 2]
            sA: cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, cute.cosize(self.a_smem_staged)],
                self.buffer_align_bytes]
            sB: cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, cute.cosize(self.b_smem_staged)],
                self.buffer_align_bytes]
            sC: cute.struct.Align[
                cute.struct.MemRange[self.c_dtype, cute.cosize(self.epi_smem_staged)],
                self.buffer_align_bytes]

        self.storage = Storage
        self.kernel(
            tma_a, tma_ta, tma_b, tma_tb, tma_c, tma_tc, bias, addend, self.tiled_mma,
            self.a_smem_staged, self.b_smem_staged, self.epi_smem_staged,
        ).launch(grid=[num_ctas, 1, 1], block=[self.threads_per_cta, 1, 1],
                 min_blocks_per_mp=1, stream=stream)

    def _tile_coords(self, tile: cutlass.Int32, tiles_m: cutlass.Int32,
                     tiles_n: cutlass.Int32):
        # grouped order: group_m row tiles share each column block in L2; it decides when a
        # tile runs, never what it computes
        per_group = self.group_m * tiles_n
        first_m = (tile // per_group) * self.group_m
        rows = cutlass.min(tiles_m - first_m, self.group_m)
        in_group = tile % per_group
        return first_m + in_group % rows, in_group // rows

    @cute.jit
    def _issue_k_tile(self, ab_pipe: pipeline.PipelineTmaAsync, read: pipeline.PipelineState,
                      tiled_mma: cute.TiledMma, tCrA: cute.Tensor, tCrB: cute.Tensor,
                      part: cute.Tensor):
        # one k-tile: 4 k16 WGMMAs, ascending, into part; committed as one group, not waited
        ab_pipe.consumer_wait(read)
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
            blk = (None, None, kb, read.index)
            cute.gemm(tiled_mma, part, tCrA[blk], tCrB[blk], part)
        cute.nvgpu.warpgroup.commit_group()

    @cute.jit
    def _mma_k_tile(self, ab_pipe: pipeline.PipelineTmaAsync, read: pipeline.PipelineState,
                    tiled_mma: cute.TiledMma, tCrA: cute.Tensor, tCrB: cute.Tensor,
                    part: cute.Tensor, total: cute.Tensor, kt: cutlass.Int32,
                    k_tiles: cutlass.Int32):
        # one k-tile into part; at the end of each 256-k chunk and after the last k-tile:
        # drain, total += part (IEEE fp32), then part = zeros
        self._issue_k_tile(ab_pipe, read, tiled_mma, tCrA, tCrB, part)
        if (kt + 1) % PROMOTE == 0 or kt + 1 == k_tiles:
            cute.nvgpu.warpgroup.wait_group(0)
            total.store(total.load() + part.load())
            part.fill(0.0)
        else:
            cute.nvgpu.warpgroup.wait_group(1)  # the previous k-tile's MMAs are done

    @cute.jit
    def _overlapped_step(self, ab_pipe: pipeline.PipelineTmaAsync,
                         read: pipeline.PipelineState, release: pipeline.PipelineState,
                         tiled_mma: cute.TiledMma, tCrA: cute.Tensor, tCrB: cute.Tensor,
                         part: cute.Tensor, part2: cute.Tensor, total: cute.Tensor,
                         j: cutlass.Constexpr[int]):
        # step j of 8 (see the consumer loop): issue into this chunk's partial, wait until
        # only it is in flight, hand the previous k-tile's stage back (the caller advances
        # the states), and add the chunk that just ended
        if cutlass.const_expr(3 <= j < 7):
            self._issue_k_tile(ab_pipe, read, tiled_mma, tCrA, tCrB, part2)
        else:
            self._issue_k_tile(ab_pipe, read, tiled_mma, tCrA, tCrB, part)
        cute.nvgpu.warpgroup.wait_group(1)
        ab_pipe.consumer_release(release)
        if cutlass.const_expr(j == 3):
            total.store(total.load() + part.load())
            part.fill(0.0)
        if cutlass.const_expr(j == 7):
            total.store(total.load() + part2.load())
            part2.fill(0.0)

    @cute.jit
    def _read_addend(self, addend: cute.Tensor, thr_mma_t, cC: cute.Tensor, tm: cutlass.Int32,
                     tn: cutlass.Int32, total: cute.Tensor, add: cutlass.Constexpr[bool]):
        # total = addend (the seed) or addend + total (IEEE float32, commutative: Triton's
        # c + acc), per accumulator value; rows >= M and columns >= N read a clamped element
        # and are never stored
        tCcC = thr_mma_t.partition_C(cC[(None, None, tm, tn)])
        m_last = cute.size(addend, mode=[0]) - 1
        n_last = cute.size(addend, mode=[1]) - 1
        for i in cutlass.range_constexpr(cute.size(total)):
            m = cutlass.min(tCcC[i][0], m_last)
            n = cutlass.min(tCcC[i][1], n_last)
            if cutlass.const_expr(add):
                total[i] = addend[m, n] + total[i]
            else:
                total[i] = addend[m, n]

    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom,
               mB: cute.Tensor, tma_c: cute.CopyAtom, mC: cute.Tensor, bias: cute.Tensor,
               addend: cute.Tensor, tiled_mma: cute.TiledMma,
               a_smem_staged: cute.ComposedLayout, b_smem_staged: cute.ComposedLayout,
               epi_smem_staged: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_wg)

        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_c)

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.storage)
        one_stage = (None, None, 0)
        stage_bytes = (cute.size_in_bytes(self.ab_dtype, cute.slice_(a_smem_staged, one_stage))
                       + cute.size_in_bytes(self.ab_dtype, cute.slice_(b_smem_staged, one_stage)))
        # full barriers: TMA transaction bytes; empty barriers: one arrive per consumer warp
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_mbar.data_ptr(),
            num_stages=self.ab_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     self.num_mma_warp_groups * 4),
            tx_count=stage_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            defer_sync=True,
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        sC = storage.sC.get_tensor(epi_smem_staged.outer, swizzle=epi_smem_staged.inner)

        # (bM, bK, tiles_m, tiles_k), (bN, bK, tiles_n, tiles_k), (bM, bN, tiles_m, tiles_n)
        gA = cute.local_tile(mA, (self.tile_m, TILE_K), (None, None))
        gB = cute.local_tile(mB, (self.tile_n, TILE_K), (None, None))
        gC = cute.local_tile(mC, (self.tile_m, self.tile_n), (None, None))
        tiles_m = cute.size(gA, mode=[2])
        tiles_n = cute.size(gB, mode=[2])
        k_tiles = cute.size(gA, mode=[3])
        num_tiles = tiles_m * tiles_n

        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))

        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
        # ---------------- producer: one warp issues the TMA loads ----------------
        if warp_idx == 0:
            prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
            tile = bidx
            while tile < num_tiles:
                tm, tn = self._tile_coords(tile, tiles_m, tiles_n)
                tAgA_t = tAgA[(None, tm, None)]
                tBgB_t = tBgB[(None, tn, None)]
                for kt in range(k_tiles):
                    ab_pipe.producer_acquire(prod)
                    bar = ab_pipe.producer_get_barrier(prod)
                    cute.copy(tma_a, tAgA_t[(None, kt)], tAsA[(None, prod.index)], tma_bar_ptr=bar)
                    cute.copy(tma_b, tBgB_t[(None, kt)], tBsB[(None, prod.index)], tma_bar_ptr=bar)
                    ab_pipe.producer_commit(prod)
                    prod.advance()
                tile += gdim
            ab_pipe.producer_tail(prod)

        # ---------------- consumers: WGMMA, promotion, epilogue ----------------
        if wg_idx > 0:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            ctid = tidx - self.threads_per_wg  # thread index among the consumers
            # WGMMA is partitioned per warpgroup, the coordinates per thread
            thr_mma = tiled_mma.get_slice((wg_idx - 1) * self.threads_per_wg)
            thr_mma_t = tiled_mma.get_slice(ctid)
            tCsA = thr_mma.partition_A(sA)
            tCsB = thr_mma.partition_B(sB)
            tCrA = tiled_mma.make_fragment_A(tCsA)
            tCrB = tiled_mma.make_fragment_B(tCsB)
            acc_shape = thr_mma.partition_C(gC[(None, None, 0, 0)]).shape
            part = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
            total = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
            part2 = part
            if cutlass.const_expr(self.overlap):
                part2 = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
            # the partial starts from zeros in registers: every MMA accumulates
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)

            # (m, n) coordinates of this thread's accumulator values, for bias and addend
            cC = cute.local_tile(cute.make_identity_tensor(mC.shape), (self.tile_m, self.tile_n),
                                 (None, None))

            # epilogue: registers -> shared (stmatrix) -> global (TMA store)
            r2s_atom = sm90_utils.sm90_get_smem_store_op(
                self.c_layout, elem_ty_d=self.c_dtype, elem_ty_acc=self.acc_dtype)
            # stmatrix's 16-bit atom gives the source layout; a float32 output is stored to
            # shared memory by plain stores (r2s_atom) in that layout
            stm_atom = cute.make_copy_atom(
                cute.nvgpu.warp.StMatrix8x8x16bOp(self.c_layout.is_m_major_c(), 4), self.ab_dtype)
            r2s = cute.make_tiled_copy_S(r2s_atom, cute.make_tiled_copy_C_atom(stm_atom, tiled_mma))
            thr_r2s = r2s.get_slice(ctid)
            tRS_sC = thr_r2s.partition_D(sC)
            tRS_total = r2s.retile(total)
            rC_shape = cute.shape(thr_r2s.partition_S(sC))[:3]
            tRS_f32 = cute.make_rmem_tensor(rC_shape, self.acc_dtype)
            tRS_out = cute.make_rmem_tensor(rC_shape, self.c_dtype)
            n_rC = cute.size(tRS_f32)
            store_pipe = pipeline.PipelineTmaStore.create(
                num_stages=self.epi_stage,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                         self.num_mma_threads),
            )

            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
            release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                   self.ab_stage)
            tiles_done = cutlass.Int32(0)
            tile = bidx
            while tile < num_tiles:
                tm, tn = self._tile_coords(tile, tiles_m, tiles_n)
                if cutlass.const_expr(self.addend == "seed"):
                    self._read_addend(addend, thr_mma_t, cC, tm, tn, total, False)
                else:
                    total.fill(0.0)
                part.fill(0.0)
                if cutlass.const_expr(self.overlap):
                    # k_tiles % 8 == 0 (the host's choice). Chunks alternate between part
                    # (even) and part2 (odd). k-tile 0 is peeled; the rest run as steps of 8
                    # k-tiles kt = 8i + 1 + j, then a tail of 7: for j in 0..7 the chunk of kt
                    # is even for j < 3 or j == 7, odd for 3 <= j < 7; a chunk ends when the
                    # next one starts (j == 3 adds part, j == 7 adds part2), right after the
                    # wait that completes its last k-tile; the last chunk (odd) after the loop
                    part2.fill(0.0)
                    self._issue_k_tile(ab_pipe, read, tiled_mma, tCrA, tCrB, part)
                    read.advance()
                    for _step in range(k_tiles // 8 - 1):  # step i
                        for j in cutlass.range_constexpr(8):
                            self._overlapped_step(ab_pipe, read, release, tiled_mma, tCrA,
                                                  tCrB, part, part2, total, j)
                            release.advance()
                            read.advance()
                    for j in cutlass.range_constexpr(7):
                        self._overlapped_step(ab_pipe, read, release, tiled_mma, tCrA, tCrB,
                                              part, part2, total, j)
                        release.advance()
                        read.advance()
                    cute.nvgpu.warpgroup.wait_group(0)
                    total.store(total.load() + part2.load())
                else:
                    # k-tile 0 is peeled so that the stage release (one behind) is
                    # unconditional
                    self._mma_k_tile(ab_pipe, read, tiled_mma, tCrA, tCrB, part, total,
                                     cutlass.Int32(0), k_tiles)
                    read.advance()
                    for kt in range(1, k_tiles):
                        self._mma_k_tile(ab_pipe, read, tiled_mma, tCrA, tCrB, part, total,
                                         kt, k_tiles)
                        # k-tile kt - 1's MMAs are complete: hand its buffers back
                        ab_pipe.consumer_release(release)
                        release.advance()
                        read.advance()
                ab_pipe.consumer_release(release)
                release.advance()

                if cutlass.const_expr(self.has_bias):
                    tCcC = thr_mma_t.partition_C(cC[(None, None, tm, tn)])
                    n_last = cute.size(bias, mode=[0]) - 1
                    for i in cutlass.range_constexpr(cute.size(total)):
                        n = cutlass.min(tCcC[i][1], n_last)  # columns >= N are never stored
                        total[i] = total[i] + bias[n].to(self.acc_dtype)
                if cutlass.const_expr(self.addend == "add"):
                    self._read_addend(addend, thr_mma_t, cC, tm, tn, total, True)

                gC_t = cute.zipped_divide(gC[(None, None, tm, tn)], self.epi_tile)
                bSG_sC, bSG_gC = cute.nvgpu.cpasync.tma_partition(
                    tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), gC_t)
                epi_tiles = cute.size(gC_t, mode=[1])
                epi_shape = gC_t.shape[1]
                epi_order = cute.make_layout(epi_shape, stride=(epi_shape[1], 1))
                for e in cutlass.range_constexpr(epi_tiles):
                    for v in cutlass.range_constexpr(n_rC):
                        tRS_f32[v] = tRS_total[e * n_rC + v]
                    tRS_out.store(tRS_f32.load().to(self.c_dtype))  # the only rounding
                    buf = (tiles_done * epi_tiles + e) % self.epi_stage
                    cute.copy(r2s, tRS_out, tRS_sC[(None, None, None, buf)])
                    cute.arch.fence_proxy("async.shared", space="cta")
                    self.epi_barrier.arrive_and_wait()
                    if warp_idx == 4:  # the first consumer warp issues the store
                        cute.copy(tma_c, bSG_sC[(None, buf)],
                                  bSG_gC[(None, epi_order.get_hier_coord(e))])
                        store_pipe.producer_commit()
                        store_pipe.producer_acquire()
                    self.epi_barrier.arrive_and_wait()
                tiles_done += 1
                tile += gdim
            store_pipe.producer_tail()
