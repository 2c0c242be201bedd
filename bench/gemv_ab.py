"""The gemv ring variant (gemv_ring_kernel: each warp's chunks and x through a ring of bulk copies) against the per-tile
kernel, in one run: per matrix (27B shapes, one token, graph-replayed calls rotating over weight copies; the ring at
several warps x stages) and in the synthetic model's decode step and a width-23 tree verify (graph replay; per-tile,
ring, and ring with programmatic dependent launch, interleaved, by switching quant_gemv.RING_UP_TO and SPECSPLIT_PDL).
Prints ratios and the fraction of the copy bandwidth each reaches.

    python3 bench/gemv_ab.py [--no-matrices] [--widths 2,3,4,8]
                             [--model PATH [--draft DRAFTER.gguf] [--step-ab ring|small|stack|wide|dnpdl|dnsrc|NAME]]
                             [--context 512] [--json out.json]

--draft: the knob modes of --step-ab NAME on the GPU drafter's captured pass (drafter_step) instead of the step.

--widths: per matrix and width, the ring against v2 and the per-tile gemv (x packed with its int16 staging).
--step-ab small: the step at 2 / 3 / 4 tokens with the ring taking the K-quant products up to 3 tokens (and the packs
writing the staging there) against v2 from two tokens. --step-ab stack: a mixed-type stack's products one after
another against its later runs on a side stream (services/engine/backend.py, STACK_CONCURRENT) at 1 / 2 / 3 tokens.
--step-ab wide: verify steps of 16 / 20 / 23 tokens with the wide kernel from 17 tokens on the K-quant matrices
against the shipped crossover (quant_wide.CROSSOVER: v2 up to 24 tokens). --step-ab dnpdl: steps of 1 / 3 / 4 / 23
tokens with a DeltaNet layer's conv, q/k norm and walk launched with PDL at every width and without it
(kernels.deltanet.PDL, PDL_UP_TO). --step-ab dnsrc: steps of 1 / 16 / 23 / 41 tokens with the DeltaNet kernels built
from kernels/deltanet.cu against those from the file $DN_BASE_SOURCE names in kernels/ (another commit's copy).
Every other NAME is an entry of STEP_ABS that sets module knobs per mode (its comment says which), e.g. swiglupair
(gate|up's cluster pairs against the shipped SwiGLU at 1 / 2 / 3 tokens), dnwarps (decode_step's warps a block),
attnkw (tree attention's warps a query tile at short contexts, 16 / 23 / 32 tokens).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MATRICES = [  # (type, rows, cols, name): the 27B Q4_K_M decode step's largest gemv launches
    ("Q4_K", 34816, 5120, "ffn_gate+up"),
    ("Q4_K", 5120, 17408, "ffn_down Q4_K"),
    ("Q6_K", 5120, 17408, "ffn_down Q6_K"),
    ("Q4_K", 5120, 6144, "ssm_out"),
    ("Q4_K", 12288, 5120, "attn_qkv"),
    ("Q6_K", 248320, 5120, "output"),
]
RING_SHAPES = [(4, 2), (4, 3), (4, 4), (4, 6), (8, 2), (8, 3), (8, 4), (2, 4)]  # (k_warps, stages)


def weight_copies(cupy, qm, tname: str, n_out: int, k: int) -> list:
    """Random copies of one matrix, enough (up to 8) that graph-replayed calls rotating over them read > 600 MB."""
    import roofline

    qtype = {"Q4_K": qm.Q4_K, "Q6_K": qm.Q6_K}[tname]
    nbytes = n_out * k * (144 if qtype == qm.Q4_K else 210) // 256
    copies = max(1, min(8, (600 << 20) // nbytes + 1))
    return [roofline.random_matrix(cupy, qm, qtype, (n_out, k)) for _ in range(copies)]


def per_matrix(cupy, qm, qg, tokens: int, copy_gbps: float) -> list[dict]:
    import roofline

    configs = [("tile", qg.GemvConfig(ring=False, splits=1))]
    configs += [(f"ring {kw}x{st}", qg.GemvConfig(ring=True, k_warps=kw, stages=st)) for kw, st in RING_SHAPES]
    rows = []
    for tname, n_out, k, label in MATRICES:
        mats = weight_copies(cupy, qm, tname, n_out, k)
        copies = len(mats)
        x = cupy.random.standard_normal((tokens, k), dtype=cupy.float32)
        px = qm.pack_activations(x, q16=True)
        out = cupy.empty((tokens, n_out), cupy.float32)
        res: dict[str, list[float]] = {}
        for _rep in range(2):
            for how, cfg in configs:
                try:
                    calls = [lambda W=W, c=cfg, px=px, o=out: qg.gemv(W, px, o, config=c) for W in mats]
                    calls *= max(1, 8 // copies)
                    us, _, _ = roofline.time_calls(cupy, calls)
                except ValueError as e:  # a shape the shared memory cannot hold
                    print(f"  {label} {how}: {e}", flush=True)
                    continue
                res.setdefault(how, []).append(us)
        nbytes = mats[0].nbytes
        row = {"matrix": label, "tokens": tokens, "MB": round(nbytes / 1e6, 1),
               "us": {how: round(min(v), 2) for how, v in res.items()}}
        best = min((v, h) for h, v in row["us"].items() if h != "tile")
        row["best_ring"], row["ratio"] = best[1], round(best[0] / row["us"]["tile"], 3)
        row["roof"] = {how: round(nbytes / (us * 1e-6) / (copy_gbps * 1e9), 3) for how, us in row["us"].items()}
        rows.append(row)
        cells = "  ".join(f"{h} {v:.1f}" for h, v in row["us"].items())
        print(f"gemv {label:14s} T={tokens} ({row['MB']} MB): {cells} us; best {best[1]} / tile {row['ratio']:.3f}"
              f" (roof tile {row['roof']['tile']:.2f}, ring {row['roof'][best[1]]:.2f})", flush=True)
        del mats
        cupy.get_default_memory_pool().free_all_blocks()
    return rows


def per_width(cupy, qm, qg, widths: list[int], copy_gbps: float) -> list[dict]:
    """Per matrix and width: the ring (4 warps x 2 stages, x from PackedX.q16) against v2 and the per-tile gemv, for
    the widths where the dispatch could hand the ring more than one token."""
    import roofline

    rows = []
    for tname, n_out, k, label in MATRICES[:5]:
        mats = weight_copies(cupy, qm, tname, n_out, k)
        copies = len(mats)
        for tokens in widths:
            x = cupy.random.standard_normal((tokens, k), dtype=cupy.float32)
            px = qm.pack_activations(x, q16=True)
            out = cupy.empty((tokens, n_out), cupy.float32)
            hows = {"ring": dict(kernel="gemv", config=qg.GemvConfig(ring=True, k_warps=4, stages=2)),
                    "tile": dict(kernel="gemv", config=qg.GemvConfig(ring=False, splits=1)),
                    "v2": dict(kernel="v2")}
            res: dict[str, float] = {}
            for how, kw in hows.items():
                calls = [lambda W=W, px=px, o=out, kw=kw: W.matmul(px, out=o, **kw) for W in mats]
                calls *= max(1, 8 // copies)
                try:
                    res[how] = min(roofline.time_calls(cupy, calls)[0] for _ in range(2))
                except ValueError:  # a width the per-tile kernel's shared memory cannot stage
                    res[how] = float("nan")
            row = {"matrix": label, "tokens": tokens, **{h: round(v, 2) for h, v in res.items()}}
            row["ring/v2"] = round(res["ring"] / res["v2"], 3)
            rows.append(row)
            print(f"width {tokens:2d} {label:14s}: ring {res['ring']:7.2f}  tile {res['tile']:7.2f}  "
                  f"v2 {res['v2']:7.2f} us  ring/v2 {row['ring/v2']:.3f}", flush=True)
        del mats
        cupy.get_default_memory_pool().free_all_blocks()
    return rows


# Step A/Bs: (name, RING_UP_TO, Q16_TOKENS, SPECSPLIT_PDL, backend.STACK_CONCURRENT or the mode's own flag) per mode,
# the widths they run at, and the ratios printed
ONE = {8: 1, 12: 1, 13: 1, 14: 1, 23: 1, 2: 1, 20: 1, 11: 1}
SMALL = {8: 1, 12: 3, 13: 3, 14: 3, 23: 3, 2: 3, 20: 3, 11: 3}  # quant_gemv.RING_UP_TO as shipped
# the dispatch tables before Q5_K and IQ4_XS joined them (session 40): their products on v2 at every width (newtypes)
_V2_NEW_TYPES = {"CROSSOVER": {1: 2, 8: 2, 12: 1, 14: 1}, "qw.CROSSOVER": {1: 17, 8: 25, 12: 25, 14: 25},
                 "qw.DEEP_CROSSOVER": {12: 4, 14: 4}, "qw.TALL_CROSSOVER": {12: 9, 14: 9},
                 "qw.HIGH_CROSSOVER": {12: 4, 14: 4}, "qw.MID_CROSSOVER": {12: 17, 14: 17},
                 "qw.WG_TYPES": {1: 1, 8: 1, 12: 1, 14: 25}}


# the dispatch tables before Q3_K, Q4_0 and IQ4_NL joined them (session 41): their products on v2 at every width
# (newtypes41; quant_gemv.RING_UP_TO without them is _RING_BEFORE_41)
_V2_TYPES_41 = {"CROSSOVER": {1: 2, 8: 2, 12: 1, 13: 1, 14: 1, 23: 1},
                "qw.CROSSOVER": {1: 17, 8: 25, 12: 25, 13: 25, 14: 25, 23: 25},
                "qw.DEEP_CROSSOVER": {12: 4, 13: 4, 14: 4, 23: 4}, "qw.TALL_CROSSOVER": {12: 9, 13: 9, 14: 9, 23: 9},
                "qw.HIGH_CROSSOVER": {12: 4, 13: 4, 14: 4, 23: 4}, "qw.MID_CROSSOVER": {12: 17, 13: 17, 14: 17, 23: 17},
                "qw.WG_TYPES": {1: 1, 8: 1, 12: 1, 13: 1, 14: 25, 23: 1}}
_RING_BEFORE_41 = {8: 1, 12: 3, 13: 3, 14: 3, 23: 3}  # (Q3_K's newtypes41 run had the ring to 1 token)


_STAGES3_BEFORE_30 = {12: (3, 4, 6), 14: (2, 3, 4, 6)}  # quant_wide.STAGES3_TILES before session 30 (w5tiles)
# quant_wide's gate|up shapes at 7 token tiles before session 31 (w7tiles): the product 1 x 4 and the SwiGLU pack
_W7_BEFORE_31 = {"qw.VERY_HIGH_SHAPES": {12: {6: (2, 8)}},
                 "qw.SWIGLU_TILES": {12: (1, 2, 3, 4, 5, 6), 14: (1, 2, 3, 4)},
                 "qw.SWIGLU_SHAPES": {12: {2: (4, 3), 5: (8, 3), 6: (8, 3)}, 14: {2: (4, 3)}}}


# kernels/quant_gemv.cu before session 32's decode (215e570's), copied into kernels/ for a run: q4kdecode's and
# ringwarp's base
_GEMV_BASE = {"SOURCE": os.environ.get("GEMV_BASE", "quant_gemv_base.cu")}


def _tall_at(n_tiles: int, shape: tuple[int, int] | None) -> dict[int, dict[int, tuple[int, int]]]:
    """quant_wide.TALL_SHAPES with this (m16 tiles a warp, warps) at n_tiles token tiles (None: none there, the
    default shape)."""
    from kernels import quant_wide as qw

    return {q: {**{n: v for n, v in tiles.items() if n != n_tiles}, **({n_tiles: shape} if shape else {})}
            for q, tiles in qw.TALL_SHAPES.items()}


STEP_ABS = {
    "ring": ([("tile", {}, 1, "off", False), ("ring", ONE, 1, "off", False), ("ring+pdl", ONE, 1, "capture", False)],
             (1, 23), [("ring", "tile"), ("ring+pdl", "ring")]),
    "small": ([("v2", ONE, 1, "capture", False), ("ring", SMALL, 3, "capture", False)], (2, 3, 4),
              [("ring", "v2")]),
    "stack": ([("sequential", SMALL, 3, "capture", False), ("concurrent", SMALL, 3, "capture", True)], (1, 2, 3),
              [("concurrent", "sequential")]),
    # the 5th field: the wide kernel from 17 tokens on every K-quant matrix (quant_wide.CROSSOVER) instead of 25
    "wide": ([("v2 to 24", SMALL, 3, "capture", False), ("wide from 17", SMALL, 3, "capture", True)], (16, 20, 23),
             [("wide from 17", "v2 to 24")]),
    # the 5th field: a DeltaNet layer's conv, q/k norm and walk launched with PDL at every width (kernels.deltanet.PDL,
    # PDL_UP_TO) or never
    "dnpdl": ([("dn plain", SMALL, 3, "capture", False), ("dn pdl", SMALL, 3, "capture", True)], (1, 3, 4, 23),
              [("dn pdl", "dn plain")]),
    # the 5th field: the DeltaNet kernels from the shipped kernels/deltanet.cu, or (False) from the file named by
    # $DN_BASE_SOURCE in kernels/ (another commit's deltanet.cu, copied there for the run)
    "dnsrc": ([("dn base", SMALL, 3, "capture", False), ("dn new", SMALL, 3, "capture", True)], (1, 16, 23, 41),
              [("dn new", "dn base")]),
    # the 5th field of these: quant_gemv attributes set for the mode (restored after); "qm." names quant_matmul's.
    # few / few2: quant_gemv.RING_FEW_SHAPE (k_warps, stages) for one-token products of few row tiles a SM
    "few": ([(f"{k}x{s}", SMALL, 3, "capture", {"RING_FEW_SHAPE": (k, s)})
             for k, s in ((4, 2), (4, 3), (4, 4), (8, 2))], (1, 2), [("4x3", "4x2"), ("4x4", "4x2"), ("8x2", "4x2")]),
    "few2": ([(f"{k}x{s}", SMALL, 3, "capture", {"RING_FEW_SHAPE": (k, s)}) for k, s in ((8, 2), (8, 3), (8, 4))]
             + [("8x2 to 6", SMALL, 3, "capture", {"RING_FEW_SHAPE": (8, 2), "RING_FEW_TILES": 6})], (1,),
             [("8x3", "8x2"), ("8x4", "8x2"), ("8x2 to 6", "8x2")]),
    "knobs": ([("shipped", SMALL, 3, "capture", {}),
               ("8x2 all", SMALL, 3, "capture", {"RING_FEW_TILES": 1 << 20}),
               ("3 stages", SMALL, 3, "capture", {"RING_STAGES": 3}),
               ("tall 8x2", SMALL, 3, "capture", {"RING_TALL_SHAPE": {1: (8, 2), 2: (8, 2), 3: (8, 2)}})],
              (1, 2, 3),
              [("8x2 all", "shipped"), ("3 stages", "shipped"), ("tall 8x2", "shipped")]),
    # the ring's bytes in flight (first measured on an H200, 1.41x the H100's copy bandwidth: would more bytes in
    # flight for the same latency pay?): RING_STAGES slots a warp, the few-tile shape with a third slot, the tall shape
    # (the LM head) with a fourth. Session 31, H200, widths 1 / 3: 1.0118 / 1.0573, 1.1124 / 1.2038, 1.0408 / 0.9995,
    # 1.0273 / 1.0017: none taken (the blocks a SM they cost outweigh the depth). Worth a re-run after session 32's
    # cheaper decode (17 % fewer instructions a chunk)
    "ringdepth": ([("shipped", SMALL, 3, "capture", {}),
                   ("3 stages", SMALL, 3, "capture", {"RING_STAGES": 3}),
                   ("4 stages", SMALL, 3, "capture", {"RING_STAGES": 4}),
                   ("few 8x3", SMALL, 3, "capture", {"RING_FEW_SHAPE": (8, 3)}),
                   ("tall 8x4", SMALL, 3, "capture", {"RING_TALL_SHAPE": {1: (8, 4), 2: (8, 3), 3: (8, 2)}})],
                  (1, 3), [("3 stages", "shipped"), ("4 stages", "shipped"), ("few 8x3", "shipped"),
                           ("tall 8x4", "shipped")]),
    # a one-token norm pack's blocks (quant_matmul.PACK_RMS_ONE_TOKEN_SCALE x pack_rms_slices')
    "packslices": ([("slices x1", SMALL, 3, "capture", {"qm.PACK_RMS_ONE_TOKEN_SCALE": 1}),
                    ("slices x2", SMALL, 3, "capture", {"qm.PACK_RMS_ONE_TOKEN_SCALE": 2}),
                    ("slices x4", SMALL, 3, "capture", {"qm.PACK_RMS_ONE_TOKEN_SCALE": 4}),
                    ("slices x8", SMALL, 3, "capture", {"qm.PACK_RMS_ONE_TOKEN_SCALE": 8})], (1,),
                   [("slices x2", "slices x1"), ("slices x4", "slices x1"), ("slices x8", "slices x1")]),
    # the step's norms staged by the product before them (qwen35_gpu.STAGE_NORMS) or packed by a launch each
    "stagenorms": ([("packs", SMALL, 3, "capture", {"q35.STAGE_NORMS": False}),
                    ("staged", SMALL, 3, "capture", {"q35.STAGE_NORMS": True})], (1, 2, 3),
                   [("staged", "packs")]),
    "stagewhere": ([("packs", SMALL, 3, "capture", {"q35.STAGE_NORMS": False}),
                    ("post", SMALL, 3, "capture", {"q35.STAGE_UP_TO": {"post": 3}}),
                    ("next", SMALL, 3, "capture", {"q35.STAGE_UP_TO": {"next": 3}}),
                    ("both", SMALL, 3, "capture", {"q35.STAGE_UP_TO": {"post": 3, "next": 3}})], (1, 2, 3),
                   [("post", "packs"), ("next", "packs"), ("both", "packs")]),
    # a DeltaNet layer's conv + q/k norm + gates in one launch (qwen35_gpu.FUSE_CONV_NORM_FROM) or two
    "convnorm": ([("two", SMALL, 3, "capture", {"q35.FUSE_CONV_NORM_FROM": 1 << 20}),
                  ("one w1", SMALL, 3, "capture", {"q35.FUSE_CONV_NORM_FROM": 1, "dn.CONV_NORM_WARPS": 1}),
                  ("one w4", SMALL, 3, "capture", {"q35.FUSE_CONV_NORM_FROM": 1, "dn.CONV_NORM_WARPS": 4})],
                 (1, 3, 23), [("one w1", "two"), ("one w4", "two")]),
    # ffn_gate_up's ring staging SwiGLU for ffn_down itself (qwen35_gpu.FUSE_SWIGLU_WIDTHS) or the SwiGLU pack
    # (warps x stages; 0 warps: gate|up's own, which keeps the step bitwise)
    "swiglu": ([("pack", SMALL, 3, "capture", {"q35.FUSE_SWIGLU_WIDTHS": ()})]
               + [(f"fused {kw}x{st}", SMALL, 3, "capture", {"q35.FUSE_SWIGLU_WIDTHS": (1, 2, 3),
                                                             "SWIGLU_SHAPE": dict.fromkeys((1, 2, 3), (kw, st))})
                  for kw, st in ((0, 2), (0, 3), (0, 4), (2, 4))], (1, 2, 3),
               [("fused 0x2", "pack"), ("fused 0x3", "pack"), ("fused 0x4", "pack"), ("fused 2x4", "pack")]),
    # ... at one token on the H200 (session 31: there the SwiGLU pack costs 169 us of a 5.7 ms step, and the tile-pair
    # blocks at gate|up's 4 x 2 are 1088 for 1056 resident, a wave and 32 blocks; 2 warps a block fit them in one wave,
    # 16.5 warps a SM; bench/ring_back_to_back.py --waves: 1056 -> 1088 tiles cost 2.7 us of 15)
    "swiglu1": ([("pack", SMALL, 3, "capture", {})]
                + [(f"fused {kw}x{st}", SMALL, 3, "capture", {"q35.FUSE_SWIGLU_WIDTHS": (1, 2),
                                                              "SWIGLU_SHAPE": {1: (kw, st), 2: (0, 3)}})
                   for kw, st in ((0, 2), (0, 3), (2, 2), (2, 3), (2, 4))], (1,),
                [(f"fused {kw}x{st}", "pack") for kw, st in ((0, 2), (0, 3), (2, 2), (2, 3), (2, 4))]),
    # the one-token kernels' Q4_K decode (kernels/quant_gemv.cu chunk_int: high nibbles in place, scales and mins by
    # byte permutes) against earlier sources of the file copied into kernels/ for the run: $GEMV_BASE (215e570's, the
    # decode before session 32) and $GEMV_NIB (a9419e5's without its coef change: the nibbles in place only); the
    # SOURCE knob names the file
    "q4kdecode": ([("base", SMALL, 3, "capture", _GEMV_BASE),
                   ("nibbles", SMALL, 3, "capture", {"SOURCE": os.environ.get("GEMV_NIB", "quant_gemv_nib.cu")}),
                   ("shipped", SMALL, 3, "capture", {})], (1, 3), [("nibbles", "base"), ("shipped", "base")]),
    # the ring gemv's warp index through a shuffle (warp-uniform to the compiler: its bulk copies' addresses in uniform
    # registers) against $GEMV_PREV (kernels/quant_gemv.cu before it, copied into kernels/ for the run) and against
    # $GEMV_BASE (before the Q4_K decode of q4kdecode)
    "ringwarp": ([("base", SMALL, 3, "capture", _GEMV_BASE),
                  ("prev", SMALL, 3, "capture", {"SOURCE": os.environ.get("GEMV_PREV", "quant_gemv_prev.cu")}),
                  ("shipped", SMALL, 3, "capture", {})], (1, 3), [("shipped", "prev"), ("shipped", "base")]),
    # the SwiGLU staged by gate|up's cluster pairs (qwen35_gpu.SWIGLU_PAIR_WIDTHS) against the shipped step (the pack at
    # one and three tokens, the tile-pair blocks at two) and against the tile-pair blocks everywhere
    "swiglupair": ([("shipped", SMALL, 3, "capture", {}),
                    ("blocks", SMALL, 3, "capture", {"q35.FUSE_SWIGLU_WIDTHS": (1, 2, 3)}),
                    ("pairs", SMALL, 3, "capture", {"q35.SWIGLU_PAIR_WIDTHS": (1, 2, 3)})], (1, 2, 3),
                   [("pairs", "shipped"), ("blocks", "shipped")]),
    # a decode token's DeltaNet layer (deltanet.decode_step) on blocks of 2 / 4 / 8 / 16 warps (16: a value head each)
    "dnwarps": ([(f"{nw} warps", SMALL, 3, "capture", {"q35.DECODE_STEP_WARPS": nw}) for nw in (2, 4, 8, 16)], (1,),
                [("4 warps", "2 warps"), ("8 warps", "2 warps"), ("16 warps", "2 warps")]),
    # a decode token's DeltaNet output norm written as ssm_out's staging by decode_step (qwen35_gpu.FUSE_DECODE_NORM,
    # a block per value head) against the norm pack after decode_step on 4-warp blocks (and on 16-warp blocks)
    "dnnorm": ([("pack 4w", SMALL, 3, "capture", {"q35.FUSE_DECODE_NORM": False}),
                ("pack 16w", SMALL, 3, "capture", {"q35.FUSE_DECODE_NORM": False, "q35.DECODE_STEP_WARPS": 16}),
                ("fused 16w", SMALL, 3, "capture", {"q35.FUSE_DECODE_NORM": True})], (1,),
               [("fused 16w", "pack 4w"), ("pack 16w", "pack 4w")]),
    # tree attention with 2 warps a query tile at short contexts (attention.default_kw: SHORT_KW_ROWS) or grid_rows's
    "attnkw": ([("kw grid_rows", SMALL, 3, "capture", {"att.SHORT_KW_ROWS": 0, "att.SHORT_KW_ROWS_F16": 0}),
                ("kw short", SMALL, 3, "capture", {})], (16, 23, 32), [("kw short", "kw grid_rows")]),
    # the attention's combine writing attn_output's int16 staging (qwen35_gpu.ATTN_STAGE_UP_TO) or a pack launch
    "attnstage": ([("pack", SMALL, 3, "capture", {"q35.ATTN_STAGE_UP_TO": 0}),
                   ("staged", SMALL, 3, "capture", {"q35.ATTN_STAGE_UP_TO": 3})], (1, 2, 3), [("staged", "pack")]),
    # the DeltaNet walk loading its committed state before its grid dependency wait (deltanet.EARLY_STATE) or after
    "dnearly": ([("after", SMALL, 3, "capture", {"dn.EARLY_STATE": False}),
                 ("early", SMALL, 3, "capture", {"dn.EARLY_STATE": True})], (1, 2, 3), [("early", "after")]),
    # an attention layer's chain (q/k norm + RoPE, KV store, partial, combine) under PDL (norm_rope.PDL) or not
    "attnpdl": ([("plain", SMALL, 3, "capture", {"nr.PDL": False}),
                 ("pdl", SMALL, 3, "capture", {"nr.PDL": True, "att.PARTIAL_PDL": True}),
                 ("pdl but partial", SMALL, 3, "capture", {"nr.PDL": True, "att.PARTIAL_PDL": False})], (1, 2),
                [("pdl", "plain"), ("pdl but partial", "plain")]),
    # a decode token's DeltaNet layer in one launch (qwen35_gpu.FUSE_DECODE_STEP: deltanet.decode_step) or three
    "dndecode": ([("three", SMALL, 3, "capture", {"q35.FUSE_DECODE_STEP": False}),
                  ("one", SMALL, 3, "capture", {"q35.FUSE_DECODE_STEP": True})], (1,), [("one", "three")]),
    # a one-token step's attention layer in one launch (qwen35_gpu.FUSE_DECODE_ATTN: attention.decode_attention) or
    # its chain of four (q/k norm + RoPE, KV store, partial, combine)
    "attndecode": ([("chain", SMALL, 3, "capture", {"q35.FUSE_DECODE_ATTN": False}),
                    ("one", SMALL, 3, "capture", {"q35.FUSE_DECODE_ATTN": True}),
                    ("one pdl", SMALL, 3, "capture", {"q35.FUSE_DECODE_ATTN": True, "att.DECODE_PDL": True}),
                    ("one 256 keys", SMALL, 3, "capture",
                     {"q35.FUSE_DECODE_ATTN": True, "att.DECODE_KEYS_PER_SPLIT": 256})],
                   (1,), [("one", "chain"), ("one pdl", "chain"), ("one 256 keys", "chain")]),
    # the SwiGLU pack writing ffn_down's int16 staging alone (qwen35_gpu.SWIGLU_STAGING_ONLY) or the fp16 x too
    "swigluonly": ([("full", SMALL, 3, "capture", {"q35.SWIGLU_STAGING_ONLY": False}),
                    ("staging only", SMALL, 3, "capture", {"q35.SWIGLU_STAGING_ONLY": True})], (1, 2, 3),
                   [("staging only", "full")]),
    # accumulating v2 / wide launches adding into y by bulk reduce-adds (quant_wide.BULK_ADDS) or a load-add-store
    "bulkadd": ([("load-add-store", SMALL, 3, "capture", {"qw.BULK_ADDS": False}),
                 ("bulk adds", SMALL, 3, "capture", {"qw.BULK_ADDS": True})], (16, 23, 32, 41),
                [("bulk adds", "load-add-store")]),
    # Q4_K deep matrices (ffn_down) on the wide kernel from 17 / 20 tokens or from 24 (quant_wide.DEEP_CROSSOVER)
    "deepq4": ([(f"deep from {d}", SMALL, 3, "capture", {"qw.DEEP_CROSSOVER": {12: d, 14: 17}}) for d in (24, 20, 17)],
               (17, 20, 23), [("deep from 20", "deep from 24"), ("deep from 17", "deep from 24")]),
    # a block's last row block added up at once when its one other sharer's pieces are in (quant_wide.PEEK) or not
    "peek": ([("store-count-read", SMALL, 3, "capture", {"qw.PEEK": False}),
              ("peek", SMALL, 3, "capture", {"qw.PEEK": True})], (17, 23, 32, 41), [("peek", "store-count-read")]),
    # every K-quant matrix on the wide kernel from 17 tokens (quant_wide.CROSSOVER; the 5120 x 6144 projections and
    # the attention's q|k|v stack take v2 up to 24 as shipped)
    "xover17": ([("shipped", SMALL, 3, "capture", {}),
                 ("all from 17", SMALL, 3, "capture", {"qw.CROSSOVER": {1: 17, 8: 25, 12: 17, 14: 17}})],
                (17, 20, 23), [("all from 17", "shipped")]),
    # the high and deep K-quant matrices on the wide kernel from 9 / 13 tokens (quant_wide.HIGH_CROSSOVER /
    # DEEP_CROSSOVER; shipped: 17)
    "wide9": ([("shipped", SMALL, 3, "capture", {})]
              + [(f"high+deep from {d}", SMALL, 3, "capture",
                  {"qw.HIGH_CROSSOVER": {12: d, 14: d}, "qw.DEEP_CROSSOVER": {12: d, 14: d}}) for d in (9, 13)],
              (9, 12, 16), [("high+deep from 9", "shipped"), ("high+deep from 13", "shipped")]),
    # programmatic dependent launch in the verify widths' products: the wide kernel's producer copies its first
    # stages' weights before the grid dependency wait (quant_wide.PDL), v2's warps theirs (qm.V2_PDL), and the packs
    # between them launch early too (qm.PACK_PDL_WIDE: kind -> first width)
    "widepdl": ([("shipped", SMALL, 3, "capture", {"qw.PDL": False, "qm.V2_PDL": False, "qm.PACK_PDL_WIDE": {}}),
                 ("wide pdl", SMALL, 3, "capture", {"qw.PDL": True, "qm.V2_PDL": False, "qm.PACK_PDL_WIDE": {}}),
                 ("wide+v2 pdl", SMALL, 3, "capture", {"qw.PDL": True, "qm.V2_PDL": True, "qm.PACK_PDL_WIDE": {}}),
                 ("+packs pdl", SMALL, 3, "capture", {"qw.PDL": True, "qm.V2_PDL": True,
                                                      "qm.PACK_PDL_WIDE": {"x": 4, "rms": 4, "silu": 4}})],
                (9, 16, 23, 41),
                [("wide pdl", "shipped"), ("wide+v2 pdl", "shipped"), ("+packs pdl", "shipped")]),
    # which packs under PDL beside the wide kernel's (quant_wide.PDL on in every mode)
    "packpdl": ([("wide pdl", SMALL, 3, "capture", {"qw.PDL": True, "qm.PACK_PDL_WIDE": {}}),
                 ("+silu", SMALL, 3, "capture", {"qw.PDL": True, "qm.PACK_PDL_WIDE": {"silu": 4}}),
                 ("+rms", SMALL, 3, "capture", {"qw.PDL": True, "qm.PACK_PDL_WIDE": {"rms": 4}}),
                 ("+all", SMALL, 3, "capture", {"qw.PDL": True, "qm.PACK_PDL_WIDE": {"x": 4, "rms": 4, "silu": 4}})],
                (9, 16, 23, 32, 41, 64),
                [("+silu", "wide pdl"), ("+rms", "wide pdl"), ("+all", "wide pdl")]),
    # the high and deep K-quant matrices on the wide kernel from 4 tokens (shipped: 9), the narrowest v2 widths
    "wide4": ([("shipped", SMALL, 3, "capture", {}),
               ("high+deep from 4", SMALL, 3, "capture",
                {"qw.HIGH_CROSSOVER": {12: 4, 14: 4}, "qw.DEEP_CROSSOVER": {12: 4, 14: 4}})],
              (4, 6, 8), [("high+deep from 4", "shipped")]),
    # every K-quant matrix on the wide kernel from 4 tokens (quant_wide.CROSSOVER, HIGH_ / DEEP_CROSSOVER) against the
    # high and deep ones alone from 4
    "all4": ([("high+deep from 4", SMALL, 3, "capture",
               {"qw.HIGH_CROSSOVER": {12: 4, 14: 4}, "qw.DEEP_CROSSOVER": {12: 4, 14: 4}}),
              ("all from 4", SMALL, 3, "capture", {"qw.CROSSOVER": {1: 17, 8: 25, 12: 4, 14: 4},
               "qw.HIGH_CROSSOVER": {12: 4, 14: 4}, "qw.DEEP_CROSSOVER": {12: 4, 14: 4}})],
             (4, 8, 12, 16), [("all from 4", "high+deep from 4")]),
    # the tall matrix (the LM head) on the wide kernel from 4 tokens too (quant_wide.TALL_CROSSOVER; shipped: 9)
    "tall4": ([("high+deep from 4", SMALL, 3, "capture",
                {"qw.HIGH_CROSSOVER": {12: 4, 14: 4}, "qw.DEEP_CROSSOVER": {12: 4, 14: 4}}),
               ("+tall from 4", SMALL, 3, "capture", {"qw.HIGH_CROSSOVER": {12: 4, 14: 4},
                "qw.DEEP_CROSSOVER": {12: 4, 14: 4}, "qw.TALL_CROSSOVER": {12: 4, 14: 4}})],
              (4, 6, 8), [("+tall from 4", "high+deep from 4")]),
    # the norm packs under PDL from 4 tokens against the shipped 25 (quant_matmul.PACK_PDL_WIDE)
    "rmspdl": ([("rms from 25", SMALL, 3, "capture", {"qm.PACK_PDL_WIDE": {"silu": 17, "rms": 25, "x": 25}}),
                ("rms from 4", SMALL, 3, "capture", {"qm.PACK_PDL_WIDE": {"silu": 17, "rms": 4, "x": 25}})],
               (4, 9, 16, 23), [("rms from 4", "rms from 25")]),
    # a wide writer's split pieces loaded two at a time before their adds (quant_wide.PIECE_GROUP) or one at a time
    "pieces": ([("one at a time", SMALL, 3, "capture", {"qw.PIECE_GROUP": False}),
                ("two at a time", SMALL, 3, "capture", {"qw.PIECE_GROUP": True})], (17, 20, 23),
               [("two at a time", "one at a time")]),
    # ... and at 4 and 5 token tiles too (quant_wide.PIECE_GROUP_TILES; shipped: Q4_K at 3 tiles), where shared memory
    # keeps the blocks a SM whatever the registers (25..40 tokens). Session 31, H200: 1.0006 / 0.9966 / 1.0008 / 0.9996
    # at 28 / 32 / 36 / 40: not taken
    "pieces45": ([("shipped", SMALL, 3, "capture", {}),
                  ("two at a time at 4-5 tiles", SMALL, 3, "capture",
                   {"qw.PIECE_GROUP_TILES": {12: (3, 4, 5), 14: (4, 5)}})], (28, 32, 36, 40),
                 [("two at a time at 4-5 tiles", "shipped")]),
    # the ring gemv (int16 staging from the packs) for the K-quant products up to 8 tokens against the shipped 3
    "ring8": ([("shipped", SMALL, 3, "capture", {}),
               ("ring to 8", {8: 1, 12: 8, 14: 8}, 8, "capture", {})],
              (4, 6, 8), [("ring to 8", "shipped")]),
    # the "high" rule of the wide kernel's dispatch (quant_wide.HIGH_ROWS, from HIGH_CROSSOVER tokens) from 10240 or
    # 6144 rows instead of 16384: the attention's q|k|v and q|k stacks (14336 / 13312 rows) and the DeltaNet attn_qkv of
    # the more-bits layers (Q6_K, 10240), then the DeltaNet gate stack (6240) too
    "high": ([("shipped", SMALL, 3, "capture", {}),
              ("high from 10240", SMALL, 3, "capture", {"qw.HIGH_ROWS": 10240}),
              ("high from 6144", SMALL, 3, "capture", {"qw.HIGH_ROWS": 6144})],
             (4, 8, 16, 23), [("high from 10240", "shipped"), ("high from 6144", "shipped")]),
    # the 10240..16383-row stacks on the wide kernel from 17 tokens (quant_wide.MID_CROSSOVER) against v2 up to 24
    "mid": ([("v2 to 24", SMALL, 3, "capture", {"qw.MID_CROSSOVER": {}}),
             ("mid from 17", SMALL, 3, "capture", {"qw.MID_CROSSOVER": {12: 17, 14: 17}})],
            (16, 17, 20, 23), [("mid from 17", "v2 to 24")]),
    # the wide kernel's stages: an accumulating launch takes fewer stages with the bulk adds' y tile where its default
    # stages leave no room for it (quant_wide.ACC_TILE_STAGES), and then 3 stages at 4 token tiles (STAGES3_TILES)
    "wstages": ([("shipped", SMALL, 3, "capture", {"qw.ACC_TILE_STAGES": False}),
                 ("acc tile", SMALL, 3, "capture", {"qw.ACC_TILE_STAGES": True}),
                 ("acc tile+3 at 4 tiles", SMALL, 3, "capture",
                  {"qw.ACC_TILE_STAGES": True, "qw.STAGES3_TILES": {12: (3, 4, 6), 14: (2, 3, 4, 6)}})],
                (32, 41, 48), [("acc tile", "shipped"), ("acc tile+3 at 4 tiles", "shipped")]),
    # the stacked gate|up (VERY_HIGH_ROWS rows or more) at 6 token tiles as 8 warps x 2 tiles (quant_wide.
    # VERY_HIGH_SHAPES; the sweep: 60.3 vs 63.6 us at 41 tokens) or 4 x 2
    "veryhigh": ([("shipped", SMALL, 3, "capture", {"qw.VERY_HIGH_SHAPES": {}}),
                  ("8x2 at 6 tiles", SMALL, 3, "capture", {"qw.VERY_HIGH_SHAPES": {12: {6: (2, 8)}, 14: {6: (2, 8)}}}),
                  ("4x2 at 6 tiles", SMALL, 3, "capture", {"qw.VERY_HIGH_SHAPES": {12: {6: (2, 4)}, 14: {6: (2, 4)}}})],
                 (41, 48), [("8x2 at 6 tiles", "shipped"), ("4x2 at 6 tiles", "shipped")]),
    # the gate|up stack's wide launch writing ffn_down's packed x itself (qwen35_gpu.FUSE_WIDE_SWIGLU) against the
    # product and the SwiGLU pack: at the shipped token tiles (quant_wide.SWIGLU_TILES), at 2 tiles too, and at the
    # shipped tiles with 8 tile pairs a row block (quant_wide.SWIGLU_WARPS, 4 shipped)
    "wswiglu": ([("pack", SMALL, 3, "capture", {"q35.FUSE_WIDE_SWIGLU": False}),
                 ("fused", SMALL, 3, "capture", {"q35.FUSE_WIDE_SWIGLU": True}),
                 ("fused 1-4 tiles", SMALL, 3, "capture", {"q35.FUSE_WIDE_SWIGLU": True,
                                                           "qw.SWIGLU_TILES": {12: (1, 2, 3, 4), 14: (1, 2, 3, 4)}}),
                 ("fused 8w", SMALL, 3, "capture", {"q35.FUSE_WIDE_SWIGLU": True, "qw.SWIGLU_WARPS": 8})],
                (4, 8, 16, 23, 32), [("fused", "pack"), ("fused 1-4 tiles", "pack"), ("fused 8w", "pack")]),
    # the SwiGLU launch at 2 token tiles too (9..16 tokens, where the shipped shape lost the step), in other shapes
    # (quant_wide.SWIGLU_SHAPES: tile pairs a row block x stages)
    "wswiglu2": ([("pack", SMALL, 3, "capture", {"q35.FUSE_WIDE_SWIGLU": False})]
                 + [(f"fused {w}x{st or 'd'}", SMALL, 3, "capture",
                     {"qw.SWIGLU_TILES": {12: (1, 2, 3, 4), 14: (1, 2, 3, 4)}, "qw.SWIGLU_SHAPES": {12: {2: (w, st)}}})
                    for w, st in ((4, 0), (4, 3), (2, 3), (2, 4), (8, 0))], (12, 16),
                 [(f"fused {w}x{st or 'd'}", "pack") for w, st in ((4, 0), (4, 3), (2, 3), (2, 4), (8, 0))]),
    # the SwiGLU launch's stages at one and two token tiles (shipped: choose_config's 2 at one, 3 at two)
    "wswiglu3": ([("pack", SMALL, 3, "capture", {"q35.FUSE_WIDE_SWIGLU": False}),
                  ("fused", SMALL, 3, "capture", {}),
                  ("3 stages at 1 tile", SMALL, 3, "capture", {"qw.SWIGLU_SHAPES": {12: {1: (4, 3), 2: (4, 3)}}}),
                  ("4 stages at 2 tiles", SMALL, 3, "capture", {"qw.SWIGLU_SHAPES": {12: {2: (4, 4)}}})], (4, 8, 16),
                 [("fused", "pack"), ("3 stages at 1 tile", "fused"), ("4 stages at 2 tiles", "fused")]),
    # the plain wide kernel with 3 stages at 2 token tiles too (quant_wide.STAGES3_TILES; the SwiGLU launch gained 3 %
    # of the step from it at 9..16 tokens), Q4_K alone and Q4_K + Q6_K (not yet run)
    "wstages2": ([("shipped", SMALL, 3, "capture", {}),
                  ("q4k 3 at 2 tiles", SMALL, 3, "capture", {"qw.STAGES3_TILES": {12: (2, 3, 4, 6), 14: (2, 3, 4, 6)}}),
                  ("q4k q6k 3 at 1-2 tiles", SMALL, 3, "capture",
                   {"qw.STAGES3_TILES": {12: (1, 2, 3, 4, 6), 14: (1, 2, 3, 4, 6)}})], (4, 8, 12, 16),
                 [("q4k 3 at 2 tiles", "shipped"), ("q4k q6k 3 at 1-2 tiles", "shipped")]),
    # the wide kernel's source against another commit's ($QW_BASE_SOURCE: a copy of its quant_matmul.cu in kernels/,
    # e.g. the SwiGLU writer before its SiLUs were all computed ahead of the shuffles)
    "qwsrc": ([("base source", SMALL, 3, "capture", {"qw.SOURCE": os.environ.get("QW_BASE_SOURCE", "quant_matmul.cu")}),
               ("this source", SMALL, 3, "capture", {})], (8, 16, 23, 32),
              [("this source", "base source")]),
    # the SwiGLU launch at 6 token tiles (41..48 tokens; quant_wide.SWIGLU_TILES), 8 tile pairs a row block (the
    # product's 8 warps x 2 tiles) with 3 stages, against the product and the SwiGLU pack there
    "wswiglu6": ([("pack from 6 tiles", SMALL, 3, "capture",
                   {"qw.SWIGLU_TILES": {12: (1, 2, 3, 4, 5), 14: (1, 2, 3, 4)},
                    "qw.SWIGLU_SHAPES": {12: {2: (4, 3), 5: (8, 3)}, 14: {2: (4, 3)}}}),
                  ("shipped", SMALL, 3, "capture", {})],
                 (36, 41, 48), [("shipped", "pack from 6 tiles")]),
    # the DFlash drafter's Q8_0 products (its block pass: 16 tokens) on the wide kernel (shipped: v2 below
    # CROSSOVER[8] = 25): from 4 tokens on its high and deep matrices (the stacked gate|up, ffn_down), or every Q8_0
    # matrix from 9 / 4 tokens. With --draft: measured on the drafter's captured pass (drafter_step), widths unused
    "q8wide": ([("shipped", SMALL, 3, "capture", {}),
                ("q8 high+deep from 4", SMALL, 3, "capture", {"qw.HIGH_CROSSOVER": {12: 4, 14: 4, 8: 4},
                                                              "qw.DEEP_CROSSOVER": {12: 4, 14: 4, 8: 4}}),
                ("q8 all from 9", SMALL, 3, "capture", {"qw.CROSSOVER": {1: 17, 8: 9, 12: 25, 14: 25}}),
                ("q8 all from 4", SMALL, 3, "capture", {"qw.CROSSOVER": {1: 17, 8: 4, 12: 25, 14: 25}})], (16,),
               [("q8 high+deep from 4", "shipped"), ("q8 all from 9", "shipped"), ("q8 all from 4", "shipped")]),
    # 5 token tiles (33..40 tokens), which no launch-shape sweep had covered before session 30: the shipped shapes
    # (the tall matrix, i.e. the LM head, with 2 tiles a warp and 4 warps as at 4 tiles, quant_wide.TALL_SHAPES; the
    # other products with 3 stages as at 4 and 6 tiles, STAGES3_TILES) against those before (1 tile x 8 warps, 2 stages)
    # and the tall shape alone
    "w5tiles": ([("before", SMALL, 3, "capture", {"qw.TALL_SHAPES": _tall_at(5, None),
                                                   "qw.STAGES3_TILES": _STAGES3_BEFORE_30}),
                 ("tall 2x4 at 5", SMALL, 3, "capture", {"qw.STAGES3_TILES": _STAGES3_BEFORE_30}),
                 ("shipped", SMALL, 3, "capture", {})],
                (36, 40), [("tall 2x4 at 5", "before"), ("shipped", "before")]),
    # 7 and 8 token tiles (49..64 tokens): 3 stages as at 3..6 tiles (quant_wide.STAGES3_TILES)
    "w78tiles": ([("shipped", SMALL, 3, "capture", {}),
                  ("3 stages at 7-8", SMALL, 3, "capture",
                   {"qw.STAGES3_TILES": {12: (3, 4, 5, 6, 7, 8), 14: (2, 3, 4, 5, 6, 7, 8)}})],
                 (56, 64), [("3 stages at 7-8", "shipped")]),
    # 7 token tiles (49..56 tokens), unswept before session 31: the shipped shapes (the tall matrix, i.e. the LM head,
    # with 2 tiles x 8 warps as at 6 and 8 tiles, quant_wide.TALL_SHAPES; the stacked gate|up as the SwiGLU launch,
    # SWIGLU_TILES, 8 pairs and 2 stages, instead of the product and the pack) against those before (1 x 8; the product
    # 1 x 4 and the pack), the tall shape alone, and the tall shape with the gate|up product as 2 x 8 (VERY_HIGH_SHAPES,
    # as at 6 tiles: where the SwiGLU launch cannot run). ptxas (nvcc 13, sm_90): qmw_kernel<Q6_K, 7, 2> spills 216 /
    # 264 bytes (at 5 and 6 tiles, shipped: 56 / 52), <Q4_K, 7, 2> and the SwiGLU <Q4_K, 7, 2, 1> none (at 8 tiles
    # both spill)
    "w7tiles": ([("before", SMALL, 3, "capture", {"qw.TALL_SHAPES": _tall_at(7, None), **_W7_BEFORE_31}),
                 ("tall 2x8 at 7", SMALL, 3, "capture", _W7_BEFORE_31),
                 ("+ gate|up 2x8 at 7", SMALL, 3, "capture", {**_W7_BEFORE_31, "qw.VERY_HIGH_SHAPES": {12: {6: (2, 8),
                                                                                                      7: (2, 8)}}}),
                 ("shipped", SMALL, 3, "capture", {})],
                (52, 56), [("tall 2x8 at 7", "before"), ("+ gate|up 2x8 at 7", "before"), ("shipped", "before")]),
    # the wide kernel's plain launches at 3 token tiles (17..24 tokens) with more blocks a SM: Q4_K's pieces one at a
    # time (96 registers instead of 127) and 2 stages (4 blocks of 4 + 1 warps a SM by shared memory and registers
    # instead of 3, about as many bytes in flight), the SwiGLU launch kept at 3 stages; and the pieces alone. Session 34
    # (H200, cc2a292): 1.008 / 1.0067 and 1.0022 / 1.0025 at widths 17 / 23: neither taken (depth over warps)
    "w3occ": ([("shipped", SMALL, 3, "capture", {}),
               ("pg1 2 stages", SMALL, 3, "capture",
                {"qw.PIECE_GROUP": False, "qw.STAGES3_TILES": {12: (4, 5, 6), 14: (2, 3, 4, 5, 6)},
                 "qw.SWIGLU_SHAPES": {12: {2: (4, 3), 3: (4, 3), 5: (8, 3), 6: (8, 3), 7: (8, 2)}, 14: {2: (4, 3)}}}),
               ("pg1 3 stages", SMALL, 3, "capture", {"qw.PIECE_GROUP": False})],
              (17, 23), [("pg1 2 stages", "shipped"), ("pg1 3 stages", "shipped")]),
    # the verify widths' packs in the wide kernel's wgmma order (quant_wide.WG_FROM: 0 never, 25 shipped) and the
    # products of them on its wgmma build (quant_wide.WG_TYPES; the v2 kernel reads that order too). Session 35 (H200):
    # every product of the packs on the wgmma build from 17 (before v2 could read the order): 0.9978 / 1.0018 / 0.9588
    # / 0.9277 / 0.882 at 17 / 23 / 32 / 41 / 64; from 17 with the 17..24 products the dispatch keeps on v2 reading
    # the order (four 32-bit loads a unit): 1.1151 / 1.107 at 17 / 23 (Q6_K on the mma.sync build: 1.0821 / 1.0791)
    "wgmma": ([("mma", SMALL, 3, "capture", {"qw.WG_FROM": 0}), ("wg from 25", SMALL, 3, "capture", {"qw.WG_FROM": 25}),
               ("wg from 17", SMALL, 3, "capture", {"qw.WG_FROM": 17})],
              (17, 23, 32, 41, 64), [("wg from 25", "mma"), ("wg from 17", "mma")]),
    # 17..24 tokens with the packs in the wgmma order and every K-quant product on the wide kernel (quant_wide.CROSSOVER
    # 17: no v2 reading the order with its extra loads), Q6_K on the wgmma build or (WG_TYPES without it) on the
    # mma.sync build reading the order. Session 36 (H200, a7dc633): 0.9913 / 0.9964 / 0.9959 and 0.9878 / 0.9884 /
    # 0.9895 at 17 / 20 / 23 (shipped as quant_wide.WG_CROSSOVER, WG_FROM 17, WG_TYPES' Q6_K from 41: --step-ab wg17)
    "wgmma17": ([("mma", SMALL, 3, "capture", {"qw.WG_FROM": 0}),
                 ("wg, all wide", SMALL, 3, "capture",
                  {"qw.WG_FROM": 17, "qw.CROSSOVER": {1: 17, 8: 25, 12: 17, 14: 17}}),
                 ("wg, all wide, Q6_K mma", SMALL, 3, "capture",
                  {"qw.WG_FROM": 17, "qw.CROSSOVER": {1: 17, 8: 25, 12: 17, 14: 17},
                   "qw.WG_TYPES": {1: 1, 8: 1, 12: 1}})],
                (17, 20, 23), [("wg, all wide", "mma"), ("wg, all wide, Q6_K mma", "mma")]),
    # Q6_K's products on the wgmma build with 3 A-fragment register sets in flight instead of 2 (quant_wide.WG_DEPTH),
    # from 25 tokens as shipped then, and from 17 with every K-quant product on the wide kernel (as wgmma17). Session
    # 36 (H200, a7dc633): 0.999 / 1.001 / 1.0009 at 23 / 32 / 41, from 17 0.9921 / 1.0013 / 1.0009: depth 2 kept
    "wgdepth": ([("depth 2", SMALL, 3, "capture", {"qw.WG_DEPTH": {}}),
                 ("Q6_K depth 3", SMALL, 3, "capture", {"qw.WG_DEPTH": {14: 3}}),
                 ("Q6_K depth 3 from 17", SMALL, 3, "capture",
                  {"qw.WG_DEPTH": {14: 3}, "qw.WG_FROM": 17, "qw.CROSSOVER": {1: 17, 8: 25, 12: 17, 14: 17}})],
                (23, 32, 41), [("Q6_K depth 3", "depth 2"), ("Q6_K depth 3 from 17", "depth 2")]),
    # session 36's first wgmma dispatch (packs in the wgmma order from 17 tokens, every K-quant product of them on the
    # wide kernel from 17 (quant_wide.WG_CROSSOVER), Q6_K's on the wgmma build from 41, raw x of attn_output and the LM
    # head packed in that order where their product runs the wgmma build) against session 35's (from 25), raw x in
    # the mma order, and Q6_K on the wgmma build from 33. H200, three rounds: 0.9855 / 0.9883 / 1.0094 / 0.9954 of
    # session 35's at 17 / 23 / 32 / 41; raw x in the mma order 0.9938 / 0.9974 / 1.001 / 1.0051; Q6_K from 33
    # 1.0023 / 0.9998 / 0.9993 / 1.0012 (so: --step-ab wgpack)
    "wg17": ([("wg from 25", SMALL, 3, "capture", {"qw.WG_FROM": 25, "q35.RAW_WG_ORDER": False,
                                                   "qw.WG_TYPES": {1: 1, 8: 1, 12: 1, 14: 1}}),
              ("wg 17", SMALL, 3, "capture", {"qw.WG_CROSSOVER": {12: 17, 14: 17},
                                              "qw.WG_TYPES": {1: 1, 8: 1, 12: 1, 14: 41}}),
              ("raw x mma order", SMALL, 3, "capture", {"qw.WG_CROSSOVER": {12: 17, 14: 17}, "q35.RAW_WG_ORDER": False,
                                                        "qw.WG_TYPES": {1: 1, 8: 1, 12: 1, 14: 41}}),
              ("Q6_K wg from 33", SMALL, 3, "capture", {"qw.WG_CROSSOVER": {12: 17, 14: 17},
                                                        "qw.WG_TYPES": {1: 1, 8: 1, 12: 1, 14: 33}})],
             (17, 23, 32, 41), [("wg 17", "wg from 25"), ("raw x mma order", "wg 17"), ("Q6_K wg from 33", "wg 17")]),
    # the shipped wgmma dispatch (a pack in the wgmma order from 17 tokens where every product reading it is wide
    # anyway, quant_wide.wg_pack: the 5120 x 6144 projections keep v2 and the mma order up to 24; raw x likewise; Q6_K
    # on the wgmma build from 25) against session 35's (from 25), wg17's "raw x mma order" (the projections on the
    # wide kernel from 17 by WG_CROSSOVER), and Q6_K on the wgmma build from 41
    "wgpack": ([("wg from 25", SMALL, 3, "capture", {"qw.WG_FROM": 25, "q35.RAW_WG_ORDER": False,
                                                     "qw.WG_TYPES": {1: 1, 8: 1, 12: 1, 14: 1}}),
                ("crossover 17", SMALL, 3, "capture", {"qw.WG_CROSSOVER": {12: 17, 14: 17}, "q35.RAW_WG_ORDER": False,
                                                       "qw.WG_TYPES": {1: 1, 8: 1, 12: 1, 14: 41}}),
                ("shipped", SMALL, 3, "capture", {}),
                ("Q6_K wg from 41", SMALL, 3, "capture", {"qw.WG_TYPES": {1: 1, 8: 1, 12: 1, 14: 41}})],
               (17, 23, 32, 41), [("shipped", "wg from 25"), ("shipped", "crossover 17"),
                                  ("Q6_K wg from 41", "shipped")]),
    # a Q5_K_M / IQ4_XS model's step with their products on the gemv, ring and wide kernels as Q4_K's (shipped since
    # session 40) against v2 at every width (the dispatch before; a session-41 type in the file: newtypes41)
    "newtypes": ([("new types on v2", {8: 1, 12: 3, 14: 3}, 3, "capture", _V2_NEW_TYPES),
                  ("shipped", SMALL, 3, "capture", {})],
                 (1, 2, 3, 8, 16, 23, 41), [("shipped", "new types on v2")]),
    # a Q3_K_M / Q4_0 / IQ4_NL model's step (make-synthetic --quant q3_k_m / q4_0 / iq4_nl) with their products on the
    # gemv, ring and wide kernels (shipped since session 41) against v2 at every width: step 3 of
    # docs/gpu_quant_matmul.md "Adding a storage type" for them (H200: Q4_0 0.719 / 0.880 / 0.600, Q3_K_M 0.679 /
    # 0.930 / 0.594 at 1 / 23 / 41 tokens, Q3_K's ring then to one token)
    "newtypes41": ([("new types on v2", _RING_BEFORE_41, 3, "capture", _V2_TYPES_41),
                    ("shipped", SMALL, 3, "capture", {})],
                   (1, 2, 3, 8, 16, 23, 41), [("shipped", "new types on v2")]),
    # Q3_K's ring at 2 and 3 tokens (shipped) against one token only (its per-tile kernel loses to the wide kernel at 2
    # tokens): 1.0006 / 0.8252 / 0.8975 / 1.0006 at 1 / 2 / 3 / 4 (H200, session 41)
    "q3kring": ([("Q3_K ring to 1", {**SMALL, 11: 1}, 3, "capture", {}), ("Q3_K ring to 3", SMALL, 3, "capture", {})],
                (1, 2, 3, 4), [("Q3_K ring to 3", "Q3_K ring to 1")]),
    # small deep matrices (the 27B's attn_v, 1024 x 5120) on v2 up to quant_wide.CROSSOVER (DEEP_MIN_ROWS 2048,
    # shipped since session 40: 0.9972 / 0.9967 / 0.9967 / 1.0007 at 4 / 8 / 16 / 23) instead of the wide kernel from
    # DEEP_CROSSOVER (0)
    "smalldeep": ([("every deep wide", SMALL, 3, "capture", {"qw.DEEP_MIN_ROWS": 0}),
                   ("small deep on v2", SMALL, 3, "capture", {"qw.DEEP_MIN_ROWS": 2048})],
                  (4, 8, 16, 23), [("small deep on v2", "every deep wide")]),
    # the products' weight copies with an evict-first L2 policy (quant_matmul.WEIGHTS_EVICT_FIRST) or none
    "evict": ([("normal", SMALL, 3, "capture", {"qm.WEIGHTS_EVICT_FIRST": False}),
               ("evict first", SMALL, 3, "capture", {"qm.WEIGHTS_EVICT_FIRST": True})], (1, 4, 16, 23, 41),
              [("evict first", "normal")]),
    "v2stages": ([("shipped", SMALL, 3, "capture", {}), ("v2 3 stages", SMALL, 3, "capture", {"qm.STAGES_V2": 3}),
                  ("v2 4 stages", SMALL, 3, "capture", {"qm.STAGES_V2": 4})], (8, 16, 23),
                 [("v2 3 stages", "shipped"), ("v2 4 stages", "shipped")]),
}


# The knob modes' names: "NAME" a quant_gemv attribute, "PREFIX.NAME" one of KNOB_MODULES[PREFIX]
KNOB_MODULES = {"": "kernels.quant_gemv", "qm": "kernels.quant_matmul", "q35": "services.engine.models.qwen35_gpu",
                "dn": "kernels.deltanet", "nr": "kernels.norm_rope", "att": "kernels.attention",
                "qw": "kernels.quant_wide"}


def knob_owner(name: str) -> tuple[object, str]:
    """(module, attribute) a STEP_ABS knob name sets; an unknown prefix or a missing attribute is an error (a typo
    would otherwise add an attribute nothing reads, and the A/B would compare two equal steps)."""
    import importlib

    prefix, _, attr = name.rpartition(".")
    if prefix not in KNOB_MODULES:
        raise ValueError(f"knob {name!r}: no module for prefix {prefix!r} (KNOB_MODULES)")
    mod = importlib.import_module(KNOB_MODULES[prefix])
    if not hasattr(mod, attr):
        raise ValueError(f"knob {name!r}: {KNOB_MODULES[prefix]} has no attribute {attr!r}")
    return mod, attr


def set_knobs(knobs: dict) -> None:
    """Set each knob (a STEP_ABS name) to its value."""
    for name, value in knobs.items():
        setattr(*knob_owner(name), value)


def step_knobs() -> list[str]:
    """Every knob name a STEP_ABS mode sets (each is saved before a run and restored after every mode)."""
    return sorted({name for modes, _, _ in STEP_ABS.values() for m in modes if isinstance(m[4], dict)
                   for name in m[4]})


def step(cupy, qm, qg, path: str, context: int, ab: str = "ring") -> list[dict]:
    import os

    from gpu_bench import model_at_context
    from step_profile import replay_us, tree_parents

    from kernels import loader

    modes, widths, ratios = STEP_ABS[ab]
    t0 = time.time()
    model, state, rng = model_at_context(path, context)
    print(f"step: loaded {path} and its context in {time.time() - t0:.0f} s", flush=True)
    from kernels import deltanet, quant_wide
    from services.engine import backend

    shipped, q16_shipped, pdl_env = dict(qg.RING_UP_TO), qm.Q16_TOKENS, os.environ.get(loader.PDL_ENV)
    stack_shipped, wide_shipped = backend.STACK_CONCURRENT, dict(quant_wide.CROSSOVER)

    knobs_shipped = {name: getattr(*knob_owner(name)) for name in step_knobs()}  # restored after every mode
    dn_pdl_shipped, dn_source = (deltanet.PDL, deltanet.PDL_UP_TO), deltanet.SOURCE
    rows = []
    try:
        for width in widths:
            toks = [int(t) for t in rng.integers(0, model.cfg.n_vocab, size=width)]
            par = tree_parents(width) if width > 1 else None
            res: dict[str, list[float]] = {}
            for _rep in range(3):
                for how, up_to, q16_tokens, pdl, flag in modes:
                    if ab == "wide":
                        quant_wide.CROSSOVER.update(wide_shipped)
                        if flag:
                            quant_wide.CROSSOVER.update({12: 17, 14: 17})
                    elif ab == "dnpdl":
                        deltanet.PDL, deltanet.PDL_UP_TO = flag, 64
                    elif isinstance(flag, dict):  # a mode of module knobs (every other entry's flag is a bool)
                        set_knobs({**knobs_shipped, **flag})
                    elif ab == "dnsrc":
                        deltanet.SOURCE = dn_source if flag else os.environ["DN_BASE_SOURCE"]
                    else:
                        backend.STACK_CONCURRENT = flag
                    qg.RING_UP_TO.clear()
                    qg.RING_UP_TO.update(up_to)
                    qm.Q16_TOKENS = q16_tokens
                    os.environ[loader.PDL_ENV] = pdl
                    model.use_graphs = True
                    state.graphs.clear()
                    for _ in range(2):  # warm-up + capture
                        model.forward(state, toks, parents=par, checkpoints=par is not None, logits="all")
                        state.pending = None
                    g = next(iter(state.graphs.values()), None)
                    if g is None:
                        raise RuntimeError(f"no graph: {model.graph_blocker}")
                    res.setdefault(how, []).append(replay_us(cupy, g.graph))
            row = {"width": width, "runs": res}
            for how in res:
                row[f"{how}_us"] = round(statistics.median(res[how]), 1)
            for a, b in ratios:
                row[f"{a}/{b}"] = round(row[f"{a}_us"] / row[f"{b}_us"], 4)
            rows.append(row)
            parts = [f"{how} {row[how + '_us']} us (runs {[round(v) for v in res[how]]})" for how in res]
            cells = ", ".join(f"{a}/{b} {row[f'{a}/{b}']}" for a, b in ratios)
            print(f"step width {width}: {', '.join(parts)}; {cells}", flush=True)
    finally:
        qg.RING_UP_TO.clear()
        qg.RING_UP_TO.update(shipped)
        qm.Q16_TOKENS = q16_shipped
        backend.STACK_CONCURRENT = stack_shipped
        quant_wide.CROSSOVER.clear()
        quant_wide.CROSSOVER.update(wide_shipped)
        deltanet.PDL, deltanet.PDL_UP_TO = dn_pdl_shipped
        deltanet.SOURCE = dn_source
        set_knobs(knobs_shipped)
        if pdl_env is None:
            os.environ.pop(loader.PDL_ENV, None)
        else:
            os.environ[loader.PDL_ENV] = pdl_env
        state.graphs.clear()
    return rows


def drafter_step(cupy, path: str, draft: str, context: int, ab: str, rounds: int = 3) -> list[dict]:
    """A STEP_ABS entry of knob modes on the GPU drafter's pass instead of the target's step: per mode and round, a
    fresh session's captured pass (3 appended rows, the 16-token block, top-8) replayed (drafter_window_ab's
    pass_replay_ms, median of 20), the modes interleaved."""
    from drafter_window_ab import pass_replay_ms
    from gpu_bench import load_gpu_model

    from services.engine.models.dflash_gpu import load_gpu_drafter

    modes, _, ratios = STEP_ABS[ab]
    if not all(isinstance(m[4], dict) for m in modes):
        raise ValueError(f"--draft takes a STEP_ABS entry of knob modes, not {ab!r}")
    model, _, _ = load_gpu_model(path)
    dr = load_gpu_drafter(draft, model)
    knobs_shipped = {name: getattr(*knob_owner(name)) for name in step_knobs()}
    res: dict[str, list[float]] = {}
    try:
        for _rep in range(rounds):
            for how, *_, knobs in modes:
                set_knobs({**knobs_shipped, **knobs})
                res.setdefault(how, []).append(pass_replay_ms(dr, cupy, context))
    finally:
        set_knobs(knobs_shipped)
    row: dict = {"context": context, "runs": res}
    for how, v in res.items():
        row[f"{how}_ms"] = round(statistics.median(v), 4)
    for a, b in ratios:
        row[f"{a}/{b}"] = round(row[f"{a}_ms"] / row[f"{b}_ms"], 4)
    parts = [f"{how} {row[how + '_ms']} ms (runs {[round(x, 3) for x in v]})" for how, v in res.items()]
    print(f"drafter pass at context {context}: {', '.join(parts)}; "
          + ", ".join(f"{a}/{b} {row[f'{a}/{b}']}" for a, b in ratios), flush=True)
    return [row]


def main(argv: list[str]) -> int:
    from kernels import loader

    reason = loader.unavailable_reason()
    if reason is not None:
        print(f"gemv_ab: skipped: {reason}")
        return 0
    cupy = loader.require()
    import roofline

    from kernels import quant_gemv as qg
    from kernels import quant_matmul as qm

    model = argv[argv.index("--model") + 1] if "--model" in argv else None
    context = int(argv[argv.index("--context") + 1]) if "--context" in argv else 512
    copy_gbps = roofline.copy_bandwidth(cupy, 1 << 30)
    print(f"copy bandwidth {copy_gbps:.0f} GB/s", flush=True)
    out: dict = {"copy_GBps": round(copy_gbps, 1)}
    if "--no-matrices" not in argv:
        out["matrices"] = per_matrix(cupy, qm, qg, 1, copy_gbps)
    if "--widths" in argv:
        widths = [int(w) for w in argv[argv.index("--widths") + 1].split(",")]
        out["widths"] = per_width(cupy, qm, qg, widths, copy_gbps)
    if model:
        ab = argv[argv.index("--step-ab") + 1] if "--step-ab" in argv else "ring"
        if "--draft" in argv:
            out["drafter"] = drafter_step(cupy, model, argv[argv.index("--draft") + 1], context, ab)
        else:
            out["step"] = step(cupy, qm, qg, model, context, ab)
    if "--json" in argv:
        Path(argv[argv.index("--json") + 1]).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
