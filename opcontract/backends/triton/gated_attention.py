"""Host code of the Triton gated_attention: the tile table (runs of a sequence's query rows,
BLOCK_M // G tokens a tile), the backward's query slots (token rows by position), the
launches."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from opcontract.backends.gated_attention import FEW_ROWS
from opcontract.backends.placement import may_keep, on_device, on_device_int32
from opcontract.backends.torch import gated_attention as ref
from opcontract.backends.triton import interpreting
from opcontract.backends.triton.launch import launch

BLOCK = ref.BLOCK
CHUNK_BLOCKS = ref.CHUNK // ref.BLOCK
AHEAD_FROM_CHUNKS = 8  # merge_ahead -1: the read-ahead merge where a tile spans more chunks
# the split decode's merge: one program per 16 rows (a decode token's 16 query heads of a KV
# group) x merge_cols channels of a tile; merge_cols -1: ``merge_cols`` decides
MERGE_ROWS, MERGE_COLS = 16, 32


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << max(n - 1, 0).bit_length())


def tiles(seq: torch.Tensor, per_tile: int, compact: bool = True) -> torch.Tensor:
    """[n, 3] int32 (first row, tokens, sequence): each run of consecutive rows of one
    sequence cut into tiles of ``per_tile`` tokens, computed where ``seq`` lives. ``compact``:
    exactly the tiles, with one read-back (how many) where ``seq`` is on a GPU; else T
    entries without a read-back (capturable), the tiles then rows of 0 tokens, whose
    programs do nothing."""
    T = seq.shape[0]
    if T == 0:
        return torch.zeros((1, 3), dtype=torch.int32, device=seq.device)
    if compact and seq.device.type == "cpu":
        return _tiles_on_host(seq.numpy(), per_tile)
    i = torch.arange(T, device=seq.device)
    new_run = torch.ones(T, dtype=torch.bool, device=seq.device)
    new_run[1:] = seq[1:] != seq[:-1]
    run_start = torch.cummax(torch.where(new_run, i, 0), dim=0).values
    starts_tile = (i - run_start) % per_tile == 0
    if compact:
        first = starts_tile.nonzero()[:, 0]
        ends = torch.cat([first[1:], torch.full_like(first[:1], T)])  # no host-to-device copy
    else:  # tile k's first row at slot k; the other rows scatter to slot T, never read
        slot = torch.where(starts_tile, torch.cumsum(starts_tile, 0) - 1, T)
        bounds = torch.full((T + 1,), T, dtype=torch.int64, device=seq.device)
        bounds.scatter_(0, slot, i)
        first = bounds[:T]  # unused slots keep T: tiles of 0 tokens
        # filled on the device: writing a Python int into a GPU tensor copies from the host,
        # which a CUDA graph capture refuses
        ends = torch.cat([bounds[1:T], torch.full_like(bounds[:1], T)])
    return torch.stack([first, ends - first, seq[first.clamp(max=T - 1)].long()],
                       dim=1).to(torch.int32)  # fmt: skip


def _tiles_on_host(seq: np.ndarray, per_tile: int) -> torch.Tensor:
    """``tiles`` of a host ``seq`` (compact), in numpy (a few rows: a Python walk)."""
    T = seq.shape[0]
    if T < FEW_ROWS:
        rows, prev, run = [], None, 0
        for i, s in enumerate(seq.tolist()):
            run = run + 1 if s == prev else 0
            prev = s
            if run % per_tile == 0:
                if rows:
                    rows[-1][1] = i - rows[-1][0]
                rows.append([i, 0, s])
        rows[-1][1] = T - rows[-1][0]
        return torch.tensor(rows, dtype=torch.int32)
    i = np.arange(T)
    new_run = np.ones(T, dtype=bool)
    new_run[1:] = seq[1:] != seq[:-1]
    run_start = np.maximum.accumulate(np.where(new_run, i, 0))
    first = np.flatnonzero((i - run_start) % per_tile == 0)
    ends = np.append(first[1:], T)
    return torch.from_numpy(np.stack([first, ends - first, seq[first]], axis=1).astype(np.int32))


# Below this many query rows a call with its index inputs on a GPU takes the tile table
# without a read-back (a decode batch: one tile per token anyway) and sizes the split by the
# key table's width.
_NO_READBACK_ROWS = 256


def no_readback(seq: torch.Tensor) -> bool:
    """Whether the plan is made from shapes alone, nothing read back from the GPU: ``seq`` on
    a GPU and the call small, or being captured into a CUDA graph. Changes no bit (padding
    tiles and chunks past a tile's last do nothing)."""
    if not seq.is_cuda:
        return False
    return seq.shape[0] <= _NO_READBACK_ROWS or torch.cuda.is_current_stream_capturing()


CONFIG_SPACE = {
    "split": (0, 1),  # split decode: chunk partials in parallel, then the ordered merge
    "block_m": (16, 64, 128),  # query rows (tokens x heads of a KV group) a tile
    "num_warps": (4, 8),
    "num_stages": (1, 2, 3),
    # blocks every live row of a tile sees whole skip the visibility mask (same bits; on by
    # default: on the H200 the training forward 2-12% and decode 2-16% faster, 0 of 24
    # outputs moved a bit: attention_forward_interior_h200.json,
    # attention_decode_interior_h200.json)
    "interior": (0, 1),
    # the fused kernel's blocks in one loop, each chunk merged inside it (same bits; off by
    # default: 2-19% slower on the H200 at 3 of 4 training shapes,
    # attention_forward_options_h200.json)
    "flat": (0, 1),
    # the fused kernel's running O in registers beside the chunk's (two accumulators), not
    # in the attn output between chunks (same bits)
    "reg_o": (0, 1),
    # the backward's launches: dq's query rows a tile, the warps of the dq and dk/dv kernels
    # and the pipeline stages of each (a tile's rows and the loads' schedule: no order changes)
    "bwd_block_m": (64, 128),
    "bwd_warps": (4, 8),
    "bwd_stages": (1, 2),
    "dkv_stages": (1, 2),
    # key rows a dk/dv program takes (a divisor of the 128-position block: more programs for
    # short causal calls, whose first blocks carry most of the work)
    "dkv_keys": (64, 128),
    # dk/dv's products key-major (S^T = k q^T): P^T and dS^T feed dv's and dk's products
    # without a transpose (each element the same dot product: same bits)
    "dkv_t": (0, 1),
    # tiles launched last-first: a causal sequence's heaviest tiles (most keys) start first
    # instead of forming the last wave (the fused forward and dq; independent programs)
    "heavy_first": (0, 1),
    # split decode in one launch: a tile's last chunk program to finish merges its partials
    # (an arrival count per tile and KV head; the merge kernel's arithmetic and order). Off:
    # on the H200 +1-4% at B = 1, -4% at B = 64 (attention_decode_kernels_merge_in_h200.json)
    "merge_in": (0, 1),
    # the merge kernel's pipeline stages (its loop reads four chunks' partials an iteration:
    # more stages read the next four while these merge; no order changes). 1: 2 and 3
    # changed nothing on the H200 (attention_decode_merge_stages_h200.json)
    "merge_stages": (1, 2, 3),
    # the merge reads four chunks a load, eight chunks ahead of its merges (the same merges in
    # the same order). Default -1: on where a tile spans more than 8 chunks. On the H200
    # (attention_decode_parts_h200.json) at L = 32768 (64 chunks) the merge took 17.8 / 27.3
    # / 35.1 -> 15.9 / 17.5 / 26.9 us at B = 1 / 8 / 64 (0.250 / 0.586 / 0.869 -> 0.268 /
    # 0.644 / 0.880 of the copy rate). At L = 8192 (16 chunks) it lost with 32 channels a
    # program (5.1 -> 5.7 us at B = 1) and wins with the 8 that ``merge_cols`` gives there:
    # on an H100 5.80 -> 3.27 us at B = 1, 6.02 -> 4.30 at B = 8
    # (attention_decode_merge_cuts_reverted_h100.json)
    "merge_ahead": (0, 1),
    # split decode: a chunk's block rows read together before its blocks (``_chunk_rows``),
    # not one load a block on the way to its keys (addresses only: the same bits). On by
    # default: on an H100 the chunk kernel 0.25-3.6% faster at all six decode shapes timed
    # (B = 1 / 8 / 64, L = 8192 / 32768, two stages), 0 of 24 outputs moved a bit; with it a
    # third stage gets its second buffer (attention_decode_rows_first_h100.json). 2: on a
    # global layer the rows (and q) read at the program's start, beside the positions and
    # the key length, not after the key bounds computed from them (one memory wait fewer
    # before the first keys; a local layer's chunk bounds need the positions: as 1). On the
    # H200 2 gained nothing over 1 (chunk kernel 10.24 against 10.27 us at B = 1, L = 8192,
    # 23.03 against 22.64 at B = 8; attention_decode_rows_first_h200.json)
    "rows_first": (0, 1, 2),
    # the merge kernel's programs: channels a program merges (of 128; fewer: more programs,
    # each with less in flight per chunk) and its warps. The merge is per element: how the
    # tile is cut changes no bit
    "merge_cols": (8, 16, 32, 64),  # -1 (default): ``merge_cols``
    "merge_warps": (1, 2, 4),
}


def default_config(call=None) -> dict:
    """Fused unless the tiles alone leave most of the GPU idle (split -1: decided by
    occupancy). Calls of 1024 tokens or more (training, prefill): tiles of 128 query rows,
    two stages, 8 warps; on the H200 128 rows ran the training forward 1.1-1.7x faster than
    64, and two stages beat one at 4 of the 6 training shapes measured
    (attention_fastpass_h200.json, attention_forward_explore_h200.json), and the running O
    in registers (reg_o: the fused kernel 1.25-1.32x faster in GPU time at L = 8192 and
    16384 global, 1.07-1.09x local, attention_kernel_time_reg_o_lean_h200.json). Decode calls
    (at most one query token a sequence): tiles of 16 rows (one token's 16 heads), two
    stages (three where few split programs run: ``decode_stages``), 4 warps
    (``_one_token_a_sequence``; 1, 2 and 8 warps read the cache slower at every decode
    batch measured on an H100, attention_decode_stages_h100.json,
    attention_decode_warps8_h100.json). Other smaller calls (prefill chunks): 64
    rows, one stage, 4 warps, which read the cache 1.1-1.5x faster than 8 warps at every
    decode batch of 8 to 256 measured (attention_decode_explore_h200.json,
    attention_decode_merge_h200.json), except a single token, two stages (23.5 -> 20.1 us at
    L = 8192 and 34.3 -> 32.2 us at 32768, attention_decode_single_pass_h200.json). The contract
    fixes no tile: no choice here changes a bit (the same files, attention_configs_h200.json).
    The backward from 1024 rows: dq in tiles of 128 rows and both gradient kernels with two
    stages, forward+backward 1.37-1.48x faster in GPU time than 64 rows and one stage at
    L = 8192 and 16384, global and local (8 warps: 4 ran 1.6-2.5x slower;
    attention_backward_options_h200.json)."""
    sizes = getattr(call, "sizes", None) or {}
    return _defaults(sizes.get("T"), sizes.get("S"))


def _defaults(T: int | None, S: int | None = None) -> dict:
    """default_config's choices for a call of T query rows over S sequences (None:
    unknown)."""
    decode = _one_token_a_sequence(T, S)
    return {"split": -1, "block_m": 16 if decode else _block_m(T), "num_warps": _warps(T),
            "num_stages": -1 if decode else _stages(T), "interior": 1, "flat": 0,
            "reg_o": int(T is not None and T >= 1024),
            "bwd_block_m": _block_m(T), "bwd_warps": 8,
            "bwd_stages": 2 if T is not None and T >= 1024 else 1,
            "dkv_stages": 2 if T is not None and T >= 1024 else 1,
            # 64 keys a dk/dv program from T = 1024 (attention_backward_options_h100.json:
            # the dk/dv kernel 2.4x faster at L = 8192 global, equal bits)
            "dkv_keys": 64 if T is not None and T >= 1024 else BLOCK,
            "dkv_t": 0, "heavy_first": 0, "merge_in": 0, "merge_stages": 1,
            "merge_ahead": -1, "rows_first": 1, "merge_cols": -1,
            "merge_warps": 2}  # fmt: skip


def _one_token_a_sequence(T: int | None, S: int | None) -> bool:
    """A decode call (at most one query row a sequence): its tiles hold one token's G heads
    whatever their size, so the forward takes tiles of 16 rows (raised to G where G is
    larger), which waste no MMA rows. Their bits are the 64- and 128-row tiles' (the block
    row sum is written out in one order, ``_block_sum``): on an H100, 0 of 40 decode
    configurations differed in out or lse from the earlier kernels' training tile, and
    they read the cache at 0.62 / 0.88 / 0.92 of the copy rate at B = 8 / 64 / 256,
    L = 8192 (two stages), where 64 rows read at 0.53 / 0.68 / 0.72
    (attention_row_sum_decode_h100.json); on the H200 0.114 / 0.50 / 0.81 at B = 1 / 8 / 64
    against 0.099 / 0.40 / 0.57 (attention_decode_kernels_merge_in_h200.json,
    attention_decode_interior_h200.json)."""
    return T is not None and S is not None and 0 < T <= S


def _block_m(T: int | None) -> int:
    return 128 if T is not None and T >= 1024 else 64


def _stages(T: int | None) -> int:
    return 2 if T is not None and (T >= 1024 or T == 1) else 1


def _warps(T: int | None) -> int:
    return 8 if T is not None and T >= 1024 else 4


def _split_pays(n_programs: int, n_chunks: int, num_warps: int, device) -> bool:
    if device.type != "cuda" or n_chunks < 2:
        return False
    # measured on the H200 (attention_decode_merge_h200.json, L = 2048 .. 32768): with 4
    # warps (two programs an SM) split wins up to B = 64 (128 programs) and loses at
    # B = 256 (512); with 8 warps (one an SM) it won at B <= 8 (16 programs) and lost
    # 15-18% at B = 64 (attention_h200.json)
    sms = _sms(device)
    return n_programs <= 2 * sms if num_warps <= 4 else 2 * n_programs <= sms


def chunks_per_tile(table: torch.Tensor, positions: torch.Tensor, window: int, local: bool) -> int:
    """The most key chunks any tile's rows span (the split grid's second axis), by the
    kernels' own rule: chunks b_lo // CHUNK_BLOCKS .. b_hi // CHUNK_BLOCKS of the tile."""
    on_host = positions.device.type == "cpu" and table.device.type == "cpu"
    if on_host and positions.shape[0] >= FEW_ROWS:  # fewer rows: the plain loop is quicker
        return _chunks_on_host(table.numpy(), positions.numpy(), window, local)
    pos = positions.tolist()
    most = 0
    for row0, n, _ in table.tolist():
        p = [x for x in pos[row0 : row0 + n] if x >= 0]
        if not p:
            continue
        lo = max(min(p) - window + 1, 0) if local else 0
        most = max(most, max(p) // ref.CHUNK - lo // ref.CHUNK + 1)
    return most


def _chunks_on_host(table: np.ndarray, pos: np.ndarray, window: int, local: bool) -> int:
    """``chunks_per_tile`` of a compact table (its tiles cover the rows in order), in numpy."""
    if pos.size == 0:
        return 0
    live = pos >= 0
    first = table[:, 0]
    top = np.maximum.reduceat(np.where(live, pos, -1), first)
    low = np.minimum.reduceat(np.where(live, pos, np.iinfo(np.int64).max), first)
    seen = top >= 0
    if not seen.any():
        return 0
    top, low = top[seen].astype(np.int64), low[seen].astype(np.int64)
    lo = np.maximum(low - window + 1, 0) if local else np.zeros_like(low)
    return int((top // ref.CHUNK - lo // ref.CHUNK + 1).max())


@dataclass
class ForwardPlan:
    """What the host decides for one forward (tile table, fused or split, workspace):
    ``run_forward`` then only launches kernels, so a decode step can be graph-captured."""

    table: torch.Tensor
    split: bool
    n_chunks: int
    meta: dict
    c: float
    window: int
    interior: bool = False  # the launch options (CONFIG_SPACE's), per kernel that takes them
    flat: bool = False
    reg_o: bool = False
    go: torch.Tensor | None = None  # ones: every program of the fast pass runs
    redo: torch.Tensor | None = None  # the fast pass's flags: the SAFE pass's programs
    partials: tuple[torch.Tensor, ...] = ()  # split: (m, l, o) of every chunk
    counts: torch.Tensor | None = None  # split, merge_in: arrivals per tile and KV head (0)
    merge_stages: int = 1
    merge_ahead: bool = False
    merge_cols: int = MERGE_COLS
    merge_warps: int = 2
    rows_first: int = 0  # split: CONFIG_SPACE's rows_first


def plan_forward(config, q, k, positions, seq, block_rows, *, layer, window, scale,
                 place: bool = True) -> ForwardPlan:  # fmt: skip
    """The plan of a forward call. ``config`` keys: CONFIG_SPACE's (split -1: decide by
    occupancy); no choice changes a bit. ``place``: the tile table on q's device (else
    where it was computed, for the caller to place)."""
    cfg = _defaults(q.shape[0], block_rows.shape[0])
    cfg.update(config or {})
    _, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    NB = block_rows.shape[1]
    block_m = max(int(cfg["block_m"]), _pow2(G))
    bounded = no_readback(seq)
    table = tiles(seq, max(1, block_m // G), compact=not bounded)
    if cfg.get("heavy_first"):
        table = table.flip(0).contiguous()
    local = layer == "local"
    split = int(cfg["split"])
    if split < 0:
        split = int(
            _split_pays(
                table.shape[0] * Hkv, -(-NB // CHUNK_BLOCKS), int(cfg["num_warps"]), q.device
            )
        )
    if not split:
        n_chunks = 0
    elif bounded:  # the most chunks a tile can span; a program past its tile's last exits
        n_chunks = -(-NB // CHUNK_BLOCKS)
    else:
        n_chunks = chunks_per_tile(table, positions, int(window or 0), local)
    meta = dict(LOCAL=local, INTERPRET=interpreting(), BLOCK_M=block_m, BLOCK=BLOCK,
                BLOCK_D=_pow2(D), CHUNK_BLOCKS=CHUNK_BLOCKS, num_warps=int(cfg["num_warps"]),
                num_stages=int(cfg["num_stages"]))  # fmt: skip
    plan = ForwardPlan(on_device(table, q.device) if place else table,
                       bool(split and n_chunks > 1), n_chunks, meta, ref.score_factor(D, scale),
                       int(window or 0), bool(cfg["interior"]), bool(cfg["flat"]),
                       bool(cfg.get("reg_o", 0)))  # fmt: skip
    programs = table.shape[0] * Hkv * (n_chunks if plan.split else 1)
    if not plan.split:  # the fused kernel's two passes (the split kernel redoes in-program)
        plan.go = _ones(programs, q.device)
        plan.redo = torch.empty(programs, dtype=torch.int32, device=q.device)  # zeroed per run
    else:
        slots = programs * block_m
        part_m = torch.empty(slots, dtype=torch.float32, device=q.device)
        part_o = torch.empty((slots, _pow2(D)), dtype=torch.float32, device=q.device)
        plan.partials = (part_m, torch.empty_like(part_m), part_o)
        plan.merge_stages = int(cfg.get("merge_stages", 1))
        cols = int(cfg["merge_cols"])
        plan.merge_cols = cols if cols > 0 else merge_cols(
            table.shape[0] * Hkv, meta["BLOCK_M"], meta["BLOCK_D"], _sms(q.device))
        plan.merge_warps = int(cfg["merge_warps"])
        ahead = int(cfg["merge_ahead"])  # (-1 from _defaults unless the config says)
        plan.merge_ahead = bool(ahead if ahead >= 0 else n_chunks > AHEAD_FROM_CHUNKS)
        plan.rows_first = int(cfg["rows_first"])
        if cfg.get("merge_in"):  # each call leaves them 0 again (the last arrival resets)
            plan.counts = torch.zeros(table.shape[0] * Hkv, dtype=torch.int32, device=q.device)
    if int(cfg["num_stages"]) < 0:  # decode's default
        plan.meta["num_stages"] = decode_stages(programs, plan.rows_first, _sms(q.device))
    return plan


def merge_cut(block_m: int, block_d: int, merge_cols: int) -> tuple[int, int, int]:
    """(rows, channels, programs) of one tile and KV head in the split merge's grid."""
    rows = min(MERGE_ROWS, block_m)
    cols = min(merge_cols, block_d)
    return rows, cols, (block_m // rows) * (block_d // cols)


def merge_cols(tiles: int, block_m: int, block_d: int, sms: int) -> int:
    """The split merge's channels a program (merge_cols -1) for ``tiles`` tiles and KV
    heads: the fewest of 8, 16, 32 that leave at most four merge programs an SM, else 32. A
    merge program's time is a chain of loads and merges, so more, narrower programs finish
    sooner until they queue. On an H100 (attention_decode_merge_cuts_reverted_h100.json, 2
    warps, every row equal in bits) the merge took 6.69 us with 8 channels against 15.84 with
    32 at B = 1, L = 32768 (32 against 8 programs; 0.389 -> 0.572 of the copy rate), 12.21
    against 16.96 at B = 8, and 3.27 / 4.30 against 5.63 / 6.05 at B = 1 / 8, L = 8192; at
    B = 64 (128 tiles and KV heads: 2048 programs at 8 channels, 512 at 32) 32 channels
    stayed fastest (30.97 against 40.28 us at L = 32768)."""
    for cols in (8, 16, 32):
        if tiles * merge_cut(block_m, block_d, cols)[2] <= 4 * sms:
            return cols
    return MERGE_COLS


def decode_stages(programs: int, rows_first: int, sms: int) -> int:
    """A decode call's pipeline stages: three (two K/V buffers in flight, 139 KB of shared
    memory: one program an SM) where its split programs read their block rows first and fit
    in one wave of one an SM, else two. On an H100 with rows first, three stages took the
    chunk kernel 11.17 -> 10.39 us at B = 1, L = 8192 (32 programs) and 14.07 -> 11.87 us at
    L = 32768 (128), and were 4-13% slower at B = 8 and 64 (256 programs and more)
    (attention_decode_rows_first_h100.json). No choice of stages moves a bit."""
    return 3 if rows_first and 0 < programs <= sms else 2


def _sms(device: torch.device) -> int:
    """The device's SM count (0 off the GPU)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


_ONES: dict[torch.device, torch.Tensor] = {}


def _ones(n: int, device: torch.device) -> torch.Tensor:
    """n int32 ones on ``device``: a view of one shared buffer (never written). A buffer
    first needed while a CUDA graph is captured or warmed up is that graph's own (its
    memory is the graph's pool, ``placement.may_keep``), so it is not kept for other calls."""
    buf = _ONES.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.ones(max(n, 4096), dtype=torch.int32, device=device)
        if may_keep(device):
            _ONES[device] = buf
    return buf[:n]


def run_forward(plan: ForwardPlan, q, k, v, gate, positions, block_rows, key_len, out, attn,
                lse) -> None:  # fmt: skip
    """Launch the plan's kernels (no host sync, no allocation)."""
    from opcontract.backends.triton import gated_attention_kernels as kk

    T, Hq, D = q.shape
    N, Hkv, _ = k.shape
    G, NB, n = Hq // Hkv, block_rows.shape[1], plan.table.shape[0]
    ieee = q.dtype == torch.float32
    if plan.split:  # chunk partials (each redone in its program if non-finite), then the merge
        part_m, part_l, part_o = plan.partials
        merge_in = plan.counts is not None
        counts = plan.counts if merge_in else key_len  # (not read without MERGE_IN)
        launch(kk._attn_chunk_kernel, (n, plan.n_chunks, Hkv), q, k, v, positions, block_rows,
               key_len, plan.table, part_m, part_l, part_o, gate, out, attn, lse, counts, T, N,
               Hq, Hkv, G, D, NB, plan.n_chunks, plan.window, plan.c, IEEE=ieee,
               INTERIOR=plan.interior, MERGE_IN=merge_in, AHEAD=plan.merge_ahead,
               ROWS_FIRST=plan.rows_first, **plan.meta)  # fmt: skip
        if merge_in:
            return
        rows, cols, parts = merge_cut(plan.meta["BLOCK_M"], plan.meta["BLOCK_D"],
                                      plan.merge_cols)
        meta = {**plan.meta, "num_warps": plan.merge_warps, "num_stages": plan.merge_stages}
        launch(kk._attn_merge_kernel, (n, Hkv, parts), gate, positions, key_len, plan.table,
               part_m, part_l, part_o, out, attn, lse, T, Hq, Hkv, G, D, plan.n_chunks,
               plan.window, ROWS=rows, COLS=cols, AHEAD=plan.merge_ahead, **meta)  # fmt: skip
        return
    redo = plan.redo
    redo.zero_()
    # the fast pass, then the SAFE pass over the programs it flagged (a non-finite
    # accumulator: a NaN or infinity in q, k or a value of a visited block); a flagged
    # program with finite values computes the same bits again. The SAFE pass runs
    # unpipelined (its masked products need the shared memory a second stage would take).
    for go, safe in ((plan.go, False), (redo, True)):
        meta = {**plan.meta, "num_stages": 1} if safe else plan.meta
        launch(kk._attn_fwd_kernel, (n, Hkv), q, k, v, gate, positions, block_rows, key_len,
               plan.table, out, attn, lse, go, redo, T, N, Hq, Hkv, G, D, NB, plan.window,
               plan.c, IEEE=ieee, SAFE=safe, INTERIOR=plan.interior, FLAT=plan.flat,
               REG_O=plan.reg_o, **meta)  # fmt: skip


def forward(config, q, k, v, gate, positions, seq, block_rows, key_len, *, layer, window, scale):
    """(out, lse, attn): ``plan_forward`` then ``run_forward``."""
    T, Hq, D = q.shape
    out = torch.empty_like(q)
    attn = torch.empty((T, Hq, D), dtype=torch.float32, device=q.device)
    lse = torch.empty((T, Hq), dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse, attn
    # the tile table from seq where it lives (a host seq: no wait), the kernels' inputs after
    index = (positions, block_rows, key_len)
    host = q.is_cuda and all(t.device.type == "cpu" for t in (*index, seq))
    plan = plan_forward(config, q, k, positions, seq, block_rows, layer=layer, window=window,
                        scale=scale, place=not host)  # fmt: skip
    if host:  # every index the kernels read (as int32) in one copy
        *index, plan.table = on_device_int32((*index, plan.table), q.device)
    else:
        index = [on_device(t, q.device) for t in index]
    run_forward(plan, q, k, v, gate, *index, out, attn, lse)
    return out, lse, attn


def query_slots(positions, seq, S: int, NB: int) -> torch.Tensor:
    """[S, NB, BLOCK] int32: the token row of each position of each sequence, -1 where the
    call has no query there (the backward's query blocks, indexed by position)."""
    qrow = torch.full((S * NB * BLOCK,), -1, dtype=torch.int32, device=positions.device)
    live = positions >= 0
    rows = torch.arange(positions.shape[0], dtype=torch.int32, device=positions.device)
    qrow[seq[live].long() * (NB * BLOCK) + positions[live].long()] = rows[live]
    return qrow.view(S, NB, BLOCK)


def backward(config, saved, grads, needs, *, layer, window, scale):
    """The contract's backward: d gate, A = dA and delta per row, then dq per tile of query
    rows and dk, dv per key block (no atomics: every gradient row written by one program)."""
    from opcontract.backends.triton import gated_attention_kernels as kk

    q, k, v, gate = saved["q"], saved["k"], saved["v"], saved["gate"]
    positions, seq, block_rows, key_len = (
        saved["positions"], saved["seq"], saved["block_rows"], saved["key_len"]
    )  # fmt: skip
    lse, attn = saved["lse"], saved["attn"]
    T, Hq, D = q.shape
    N, Hkv, _ = k.shape
    S, NB = block_rows.shape
    G = Hq // Hkv
    g = grads["out"]
    g = torch.zeros_like(q) if g is None else g.contiguous()
    d_gate = torch.empty_like(gate)
    da = torch.empty_like(q)
    delta = torch.empty((T, Hq), dtype=torch.float32, device=q.device)
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    if T == 0:
        return _needed(needs, dq, dk, dv, d_gate)
    interp, ieee = interpreting(), q.dtype == torch.float32
    c = ref.score_factor(D, scale)
    sc = float(torch.tensor(ref.softmax_scale(D, scale), dtype=torch.float32))
    rows = 32
    launch(kk._attn_bwd_pre_kernel, (-(-T * Hq // rows),), g, gate, attn, d_gate, da,
           delta, T * Hq, D, INTERPRET=interp, ROWS=rows, BLOCK_D=_pow2(D))  # fmt: skip
    common = dict(LOCAL=layer == "local", INTERPRET=interp, IEEE=ieee, BLOCK=BLOCK,
                  BLOCK_D=_pow2(D))  # fmt: skip
    dev = q.device  # the tile table and query slots from the index inputs where they live
    dpos, block_rows, key_len = (on_device(t, dev) for t in (positions, block_rows, key_len))
    cfg = {**_defaults(T), **(config or {})}
    warps = int(cfg["bwd_warps"])
    if needs["q"]:
        block_m = max(int(cfg["bwd_block_m"]), _pow2(G))
        table = tiles(seq, max(1, block_m // G))
        table = on_device(table.flip(0).contiguous() if cfg["heavy_first"] else table, dev)
        launch(kk._attn_bwd_dq_kernel, (table.shape[0], Hkv), q, k, v, da, delta, lse,
               dpos, block_rows, key_len, table, dq, T, N, Hq, Hkv, G, D, NB,
               int(window or 0), c, sc, BLOCK_M=block_m, num_warps=warps,
               num_stages=int(cfg["bwd_stages"]), **common)  # fmt: skip
    if needs["k"] or needs["v"]:
        qrow = on_device(query_slots(positions, seq, S, NB), dev)
        keys = int(cfg["dkv_keys"])
        if keys not in CONFIG_SPACE["dkv_keys"]:
            raise ValueError(f"config dkv_keys={keys}: one of {CONFIG_SPACE['dkv_keys']}")
        launch(kk._attn_bwd_dkv_kernel, (S * NB * (BLOCK // keys), Hkv), q, k, v, da, delta,
               lse, block_rows, key_len, qrow, dk, dv, N, Hq, Hkv, G, D, NB, int(window or 0),
               c, sc, KEYS=keys, TRANS=bool(cfg["dkv_t"]), num_warps=warps,
               num_stages=int(cfg["dkv_stages"]), **common)  # fmt: skip
    return _needed(needs, dq, dk, dv, d_gate)


def _needed(needs, dq, dk, dv, d_gate):
    return {
        "q": dq if needs["q"] else None,
        "k": dk if needs["k"] else None,
        "v": dv if needs["v"] else None,
        "gate": d_gate if needs["gate"] else None,
    }
