"""Diagnostic: clock64 stamps inside the DeltaNet walk's token loop (block 0, lane 0), one layer at 27B shapes.

    python3 bench/walk_trace.py [T]        # builds deltanet.cu with DN_TRACE

Stamps per token: 0 loop top (state ready), 1 after the ring's wait + next issue, 2 k/q rows loaded, 3 state
(re)loaded, 4 output ready, 5 after save + store; printed as cycle deltas per token.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def main() -> int:
    T = int(sys.argv[1]) if len(sys.argv) > 1 else 23
    from ncu_probe import walk_inputs

    from kernels import deltanet as dn
    from kernels import loader

    cupy = loader.require()
    dn._defines = lambda portable: ("DN_TRACE",)
    *inputs, plan = walk_inputs(cupy, T)
    for _ in range(3):
        dn.gated_delta_tree(*inputs, plan=plan)
    cupy.cuda.Device().synchronize()
    name = f"gdr_tree_walk_kernel<float, 128, 8, {dn.DEFAULT_DEPTH}>"
    mod = loader.get_module(dn.SOURCE, (name,), ("DN_TRACE",))
    buf = mod.get_global("dn_trace")
    tr = cupy.ndarray((256, 8), dtype=cupy.int64, memptr=buf).get()[:T]
    print("token  top->ring  ring->kq  kq->state  state->out  out->end  end->next  code")
    for i in range(T):
        nxt = tr[i + 1, 0] - tr[i, 5] if i + 1 < T else 0
        print(f"{i:5d} {tr[i,1]-tr[i,0]:10d} {tr[i,2]-tr[i,1]:9d} {tr[i,3]-tr[i,2]:10d} {tr[i,4]-tr[i,3]:11d} "
              f"{tr[i,5]-tr[i,4]:9d} {nxt:10d}  {tr[i,6] & 0xffff:x}")
    tot = tr[T - 1, 5] - tr[0, 0]
    print(f"total {tot} cycles for {T} tokens: {tot / T:.0f} a token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
