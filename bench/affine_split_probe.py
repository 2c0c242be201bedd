"""A timing probe of the affine dequantization split (docs/gpu_quant_matmul.md "Next: the affine dequantization
split") in the wide kernel, Q4_K only, built before the split itself to see what it buys.

patch(src) rewrites quant_matmul.cu under SS_SPLIT_PROBE: frag2's Q4_K nibble pairs as one LOP3 + one HFMA2 (low
nibbles 0x6400 + q: 1024 + q, high nibbles 0x5400 + q in bits 4-7: 64 + q; scale s, offsets -1024 s / -64 s), prep2's
offsets so with the mins kept in a fifth register, and one extra m16n8k16 a chunk per (m tile, token tile) with A the
mins and B two words of the stage: the split's instruction mix, NOT its sums (no x sums exist yet: the results are
wrong, only the time means anything). On a GPU: `python3 bench/affine_split_probe.py` (times alone, graph replays,
the mma.sync and wgmma builds); on any machine with nvcc, `--source OUT.cu` writes the patched source with a Q4_K
instantiation for a SASS count (build with -DSS_SPLIT_PROBE, and -DSPECSPLIT_QMW_WG for the wgmma build)."""
import sys
import time

import numpy as np

sys.path.insert(0, ".")

OLD_FRAG = """            a[2 * e] = hfma2(hsub2(lop3<LUT_AND_OR>(v, 0x000F000Fu, H1024), H1024), st.v[0], st.v[2]);
            a[2 * e + 1] = hfma2(hsub2(lop3<LUT_AND_OR>(v8, 0x000F000Fu, H1024), H1024), st.v[0], st.v[2]);
            a[4 + 2 * e] = hfma2(hfma2(lop3<LUT_AND_OR>(v, 0x00F000F0u, H1024), H_16TH, H_M64), st.v[1], st.v[3]);
            a[5 + 2 * e] = hfma2(hfma2(lop3<LUT_AND_OR>(v8, 0x00F000F0u, H1024), H_16TH, H_M64), st.v[1], st.v[3]);"""
NEW_FRAG = """#ifdef SS_SPLIT_PROBE
            a[2 * e] = hfma2(lop3<LUT_AND_OR>(v, 0x000F000Fu, H1024), st.v[0], st.v[2]);
            a[2 * e + 1] = hfma2(lop3<LUT_AND_OR>(v8, 0x000F000Fu, H1024), st.v[0], st.v[2]);
            a[4 + 2 * e] = hfma2(lop3<LUT_AND_OR>(v, 0x00F000F0u, 0x54005400u), st.v[1], st.v[3]);
            a[5 + 2 * e] = hfma2(lop3<LUT_AND_OR>(v8, 0x00F000F0u, 0x54005400u), st.v[1], st.v[3]);
#else
""" + OLD_FRAG + """
#endif"""
OLD_STATE = """struct RowState {
    u32 v[4];
};"""
NEW_STATE = """struct RowState {
#ifdef SS_SPLIT_PROBE
    u32 v[5];
#else
    u32 v[4];
#endif
};"""
OLD_PREP = """        st.v[0] = bcast_lo(s2);
        st.v[1] = bcast_hi(s2);
        st.v[2] = bcast_lo(m2);
        st.v[3] = bcast_hi(m2);"""
NEW_PREP = """#ifdef SS_SPLIT_PROBE
        st.v[0] = bcast_lo(s2);
        st.v[1] = bcast_hi(s2);
        st.v[2] = hmul2(bcast_lo(s2), 0xE400E400u);  // -1024 s (exact)
        st.v[3] = hmul2(bcast_hi(s2), 0xD400D400u);  // -64 s (exact)
        st.v[4] = m2;                                // the mins, A of the offsets' k-step
#else
""" + OLD_PREP + """
#endif"""
# the mma.sync build: after the chunk's 16 k-steps, the offsets' k-step per (tile, token tile)
OLD_CHUNK_END = """                                        a[mt][1][2 * st4 + 1], b0, b1);
                        }
                }
            }
        }
    } else {
        tail_mma<QT, NT, MT>(acc, wst, xs + g * 4, C, g, t);"""
NEW_CHUNK_END = """                                        a[mt][1][2 * st4 + 1], b0, b1);
                        }
                }
            }
        }
#ifdef SS_SPLIT_PROBE
        if constexpr (QT == 12) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const uint2 sb = *(const uint2*)((const u8*)xs + ((8 * nt + g) * 8 + t) * 8);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
                    mma16816_nv(acc[mt][nt], st[mt][0].v[4], st[mt][1].v[4], st[mt][0].v[4], st[mt][1].v[4], sb.x,
                                sb.y);
            }
        }
#endif
    } else {
        tail_mma<QT, NT, MT>(acc, wst, xs + g * 4, C, g, t);"""
# the wgmma build: the same k-step on mma.sync after the chunk's groups have landed
OLD_WG_END = """        wg_commit();
        wg_wait<WG_DEPTH - 1>();
    }
}
#endif  // SS_WG"""
NEW_WG_END = """        wg_commit();
        wg_wait<WG_DEPTH - 1>();
    }
#ifdef SS_SPLIT_PROBE
    if constexpr (QT == 12) {
        wg_wait<0>();
        const u8* xs = smem_ptr_probe(xs_s);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const uint2 sb = *(const uint2*)(xs + ((8 * nt + g) * 8 + t) * 8);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                mma16816_nv(acc[mt][nt], st[mt][0].v[4], st[mt][1].v[4], st[mt][0].v[4], st[mt][1].v[4], sb.x, sb.y);
        }
    }
#endif
}
#endif  // SS_WG"""


def patch(src: str) -> str:
    for old, new in ((OLD_FRAG, NEW_FRAG), (OLD_STATE, NEW_STATE), (OLD_PREP, NEW_PREP), (OLD_CHUNK_END, NEW_CHUNK_END),
                     (OLD_WG_END, NEW_WG_END)):
        assert src.count(old) == 1, old[:80]
        src = src.replace(old, new)
    # a generic pointer from a shared address (the wgmma chunk has only the address)
    helper = """
#ifdef SS_SPLIT_PROBE
SS_DEV const u8* smem_ptr_probe(u32 s) {
    u64 p;
    asm("cvta.shared.u64 %0, %1;" : "=l"(p) : "l"((u64)s));
    return (const u8*)p;
}
#endif
"""
    anchor = "// wide_chunk on wgmma: every warp"
    assert src.count(anchor) == 1
    return src.replace(anchor, helper + anchor)


def main() -> None:
    import cupy

    from kernels import loader
    from kernels import quant_matmul as qm
    from kernels import quant_wide as qw
    from tests.quant_twins import random_weights

    read = loader.read_source
    loader.read_source = lambda name: patch(read(name)) if name == "quant_matmul.cu" else read(name)
    probe = [False]
    defines = qw._defines
    qw._defines = lambda portable: defines(portable) + (("SS_SPLIT_PROBE",) if probe[0] else ())
    rng = np.random.default_rng(1)
    t0 = time.time()

    def graph_time(fn, reps=20, rounds=7):
        fn(0)
        cupy.cuda.Device().synchronize()
        s = cupy.cuda.Stream(non_blocking=True)
        with s:
            s.begin_capture()
            for i in range(reps):
                fn(i)
            g = s.end_capture()
            g.launch(s)
            s.synchronize()
            ts = []
            for _ in range(rounds):
                e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
                e0.record(s)
                g.launch(s)
                e1.record(s)
                e1.synchronize()
                ts.append(cupy.cuda.get_elapsed_time(e0, e1) * 1000 / reps)
        return float(np.median(ts))

    print("Q4_K alone, us (graph of 20 launches over two weight copies): shipped / probe / ratio, mma.sync and wgmma")
    for shape in ((34816, 5120), (5120, 17408), (16480, 5120), (5120, 6144)):
        raw = random_weights(qm.Q4_K, *shape, rng)
        Ws = [qm.QuantMatrix(qm.Q4_K, raw, shape, name="a"), qm.QuantMatrix(qm.Q4_K, raw, shape, name="b")]
        for tokens in (17, 23, 32, 41):
            x = cupy.asarray((rng.standard_normal((tokens, shape[1])) * 0.5).astype(np.float16))
            px, pw = qm.pack_activations(x, q16=False), qm.pack_activations(x, order=1, q16=False)
            out = cupy.zeros((tokens, shape[0]), cupy.float32)
            row = []
            for p, wg in ((px, False), (pw, True)):
                cfg = qw.choose_config(qm.Q4_K, *shape, tokens)
                if wg and not qw.wg_usable(cfg):
                    cfg = qw.WideConfig(cfg.m_tiles, 4, cfg.stages)
                ts, regs = [], []
                for on in (False, True):
                    probe[0] = on

                    def launch(i, p=p, cfg=cfg, wg=wg, out=out, Ws=Ws):
                        qw.wide(Ws[i % 2], p, out, config=cfg, wg=wg)

                    ts.append(graph_time(launch))
                    regs.append(qw.launch_shape(Ws[0], tokens, cfg, wg=wg)["regs"])
                probe[0] = False
                row.append(f"{'wg ' if wg else 'mma'} {ts[0]:.2f} / {ts[1]:.2f} / {ts[1] / ts[0]:.3f} (regs {regs})")
            print(f"  {shape[0]}x{shape[1]} T={tokens}: " + "; ".join(row), flush=True)
    print(f"done {time.time() - t0:.0f} s")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--source":
        from kernels import loader

        inst = ("template __global__ void qmw_kernel<12, 3, 1, 0>(const u8*, long long, int, int, const uint4*, int, "
                "float*, int, int, long long, float*, unsigned int*, int, int, int);")
        with open(sys.argv[2], "w") as f:
            f.write(patch(loader.read_source("quant_matmul.cu")) + "\n" + inst + "\n")
    else:
        main()
