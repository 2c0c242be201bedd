"""Start-up memory plan: what the target, its caches, the drafter and the scratch of the widest pass take on
each device, checked against the device's free memory, so a request never runs the device out of memory.

Everything is computed from the model files' headers (no weights are read) and the serving settings:

* weights as the backend holds them: the GPU backend keeps the stored (quantized) bytes; the NumPy backend
  dequantizes every matrix to float32 at load (4 bytes a parameter) except `token_embd`, which stays packed;
* KV cache of the attention layers for `max_ctx` tokens per slot, per side at 4 / 2 / 34/32 / 14/32 bytes per
  value for f32 / f16 / q8_0 / tq3_0, as the backend allocates it (the GPU keeps f32 as f16 and rounds the rows
  up to whole 32-key tiles: kv_cache_bytes);
* Gated DeltaNet state: the committed state plus, on the CPU, one checkpoint per verified tree node (width =
  budget + 1, a chain verifies block_size tokens, plain decoding 1), each H_v * d_k * d_v float32; on the GPU
  no per-node states (a commit replays the accepted path: docs/gpu_deltanet.md) but a second state (a chain
  step's final state) and each node's replay inputs (its conv output row and g, beta: conv_dim + 2 H_v
  float32) for the rows a GPU state allocates (CUDA_TREE_ROWS, whatever the budget); and the conv window
  (K - 1 committed rows plus one raw row per node, conv_dim float32 each);
* activations of the widest pass (the 512-token prefill chunk or the verify tree, whichever is wider),
  attention scratch (the NumPy path materialises softmax scores over the whole context; the GPU path keeps
  split-K partials), logits rows (width x vocab float32, twice: logits and the sampler's copy; on the GPU the
  device rows and the copy a replayed graph makes of a result still held);
* the drafter: its weights, its context K/V cache (every layer keeps max_ctx rows, also the sliding ones;
  f32 on NumPy, f16 on the GPU), its block's activations and logits; a drafter on another device also holds
  a copy of the target's `token_embd` and `output`;
* per slot, not on top: the GPU engine keeps finished requests' sequence states and drafter sessions (with
  their CUDA graphs) for the next requests, at most `slots` of each counting those in use
  (Qwen35GpuModel.acquire_state, DFlashGpuDrafter.acquire_session), so idle ones hold what a busy slot would;
* a fixed reserve per device: RESERVE_BYTES below (CUDA context extras, CUDA graphs, cuBLAS workspace,
  NVRTC modules and allocator fragmentation on a GPU; interpreter, gRPC and NumPy temporaries on the CPU).

Free memory: cupy's memGetInfo on a GPU, MemAvailable from /proc/meminfo for the CPU backend.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .config import ModelConfig
from .errors import SpecsplitError

GiB = 1 << 30
MiB = 1 << 20

# bytes per cached K or V value
KV_BYTES_PER_VALUE: dict[str, float] = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32, "tq3_0": 14 / 32}
# what a device keeps aside beyond the itemised buffers (see the module docstring)
RESERVE_BYTES: dict[str, int] = {"cuda": 1 * GiB, "cpu": 512 * MiB}
PREFILL_CHUNK = 512            # generate.PREFILL_CHUNK: prompts are committed in chunks this long
CTX_STEP = 256                 # a suggested --max-ctx is a multiple of this
MIN_AUTO_CTX = 4096            # a context the planner shrinks to on its own must be at least this long
CUDA_ATTN_SPLITS = 32          # split-K partials of the GPU tree attention
CUDA_KV_TILE = 32              # kernels/attention.py KT: a GPU KV cache holds whole tiles of this many rows
CUDA_TREE_ROWS = 65            # models/qwen35_gpu.MAX_TREE: rows of a GPU state's per-node buffers, any budget
DEFAULT_BLOCK_SIZE = 16
DEFAULT_BUDGET = "auto"        # the verifier's default; planned as its largest tree (AUTO_MAX_BUDGET)


class MemoryPlanError(SpecsplitError):
    """The model and settings do not fit the device; the message says what to change."""


# --------------------------------------------------------------------------------------------------
# devices


@dataclass(frozen=True)
class Device:
    kind: str                  # "cpu" | "cuda"
    index: int = 0

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"

    @property
    def backend(self) -> str:
        return "numpy" if self.kind == "cpu" else "cuda"


def parse_device(text: str) -> Device:
    """'cpu', 'cuda' (= cuda:0) or 'cuda:N'; ValueError otherwise."""
    t = str(text).strip().lower()
    if t == "cpu":
        return Device("cpu")
    if t == "cuda":
        return Device("cuda", 0)
    if t.startswith("cuda:"):
        n = t[5:]
        if n.isdigit():
            return Device("cuda", int(n))
    raise ValueError(f"expected a device 'cpu', 'cuda' or 'cuda:N', got {text!r}")


def gpu_backend_reason() -> str | None:
    """None when the engine can run on a GPU here; else why not (the kernels' reason, or a missing backend)."""
    from kernels import loader

    reason = loader.unavailable_reason()
    if reason is not None:
        return reason
    from . import backend

    if getattr(backend, "CupyBackend", None) is None:
        return "the engine has no CuPy backend yet (services.engine.backend offers NumpyBackend only)"
    return None


def check_device(device: Device) -> None:
    """Raise MemoryPlanError when `device` cannot run the engine (GPU backend missing, index out of range)."""
    if device.kind == "cpu":
        return
    reason = gpu_backend_reason()
    if reason is not None:
        raise MemoryPlanError(f"GPU backend not available: {reason} (use --device cpu)")
    import cupy

    n = int(cupy.cuda.runtime.getDeviceCount())
    if device.index >= n:
        raise MemoryPlanError(f"device {device} does not exist: {n} CUDA GPU(s) visible (cuda:0..cuda:{n - 1})")


def device_memory(device: Device) -> tuple[int, int]:
    """(free, total) bytes: the GPU's memGetInfo, or MemAvailable / MemTotal of /proc/meminfo."""
    if device.kind == "cuda":
        check_device(device)
        import cupy

        with cupy.cuda.Device(device.index):
            free, total = cupy.cuda.runtime.memGetInfo()
        return int(free), int(total)
    return cpu_memory()


def cpu_memory(meminfo: str = "/proc/meminfo") -> tuple[int, int]:
    fields: dict[str, int] = {}
    try:
        with open(meminfo) as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    fields[key] = int(parts[0]) * 1024      # values are in kB
    except OSError:
        fields = {}
    if "MemAvailable" in fields and "MemTotal" in fields:
        return fields["MemAvailable"], fields["MemTotal"]
    # not Linux: the physical memory, as free as we can know
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total, total


# --------------------------------------------------------------------------------------------------
# what the files hold


@dataclass
class WeightBytes:
    """A model file's tensors: bytes as stored and as float32, with the shared embedding/head apart."""

    stored: int
    f32: int
    embd_stored: int = 0
    embd_f32: int = 0
    output_stored: int = 0
    output_f32: int = 0
    tied: bool = False

    @classmethod
    def of(cls, tensors: dict[str, Any]) -> WeightBytes:
        wb = cls(stored=0, f32=0)
        for name, t in tensors.items():
            n32 = 4 * math.prod(t.shape)
            wb.stored += int(t.nbytes)
            wb.f32 += n32
            if name == "token_embd.weight":
                wb.embd_stored, wb.embd_f32 = int(t.nbytes), n32
            elif name == "output.weight":
                wb.output_stored, wb.output_f32 = int(t.nbytes), n32
        wb.tied = wb.output_stored == 0
        return wb

    def resident(self, backend: str) -> int:
        """Bytes the backend keeps for the whole model."""
        if backend == "cuda":
            return self.stored
        # NumPy: float32 everywhere but the packed embedding table; a tied head is a float32 copy of it
        return self.f32 - self.embd_f32 + self.embd_stored + (self.embd_f32 if self.tied else 0)

    def shared_head(self, backend: str) -> int:
        """token_embd + output as `backend` holds them (what a drafter on another device needs a copy of)."""
        if backend == "cuda":
            return self.embd_stored + (self.output_stored if not self.tied else 0)
        return self.embd_stored + (self.output_f32 if not self.tied else self.embd_f32)


@dataclass
class DrafterShape:
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    block_size: int
    n_features: int
    weights: WeightBytes


# --------------------------------------------------------------------------------------------------
# the plan


@dataclass
class PlanSettings:
    max_ctx: int
    budget: int | None = 22            # DDTree budget; None = chain
    speculative: bool = True           # a drafter (in-process or remote) proposes; False: plain decoding
    slots: int = 1
    cache_type_k: str | None = "f16"   # None / "auto": resolved for the model by plan_for_files
    cache_type_v: str | None = "f16"
    device: Device = field(default_factory=lambda: Device("cpu"))
    draft_device: Device | None = None  # None: the target's device


@dataclass
class Item:
    name: str
    bytes: int
    note: str = ""


@dataclass
class DevicePlan:
    device: str
    items: list[Item]
    free: int
    total_memory: int

    @property
    def total(self) -> int:
        return sum(i.bytes for i in self.items)

    @property
    def fits(self) -> bool:
        return self.total <= self.free

    def get(self, name: str) -> int:
        return sum(i.bytes for i in self.items if i.name == name)


@dataclass
class MemoryPlan:
    settings: PlanSettings
    devices: list[DevicePlan]
    width: int
    shrunk_from: int | None = None     # the max_ctx asked for, when the planner shrank it to fit

    @property
    def fits(self) -> bool:
        return all(d.fits for d in self.devices)

    @property
    def total(self) -> int:
        return sum(d.total for d in self.devices)

    def as_dict(self) -> dict[str, Any]:
        s = self.settings
        return {
            "fits": self.fits,
            "max_ctx": s.max_ctx,
            "shrunk_from": self.shrunk_from,
            "budget": "chain" if s.budget is None else s.budget,
            "speculative": s.speculative,
            "width": self.width,
            "slots": s.slots,
            "cache_type_k": s.cache_type_k,
            "cache_type_v": s.cache_type_v,
            "total_bytes": self.total,
            "devices": [{"device": d.device, "total_bytes": d.total, "free_bytes": d.free,
                         "device_bytes": d.total_memory, "fits": d.fits,
                         "items": [{"name": i.name, "bytes": i.bytes, "note": i.note} for i in d.items]}
                        for d in self.devices],
        }

    def summary(self) -> str:
        """One line for the start-up log."""
        s = self.settings
        parts = []
        for d in self.devices:
            big = sorted(d.items, key=lambda i: -i.bytes)[:4]
            parts.append(f"{d.device}: {_gib(d.total)} of {_gib(d.free)} free ("
                         + ", ".join(f"{i.name} {_gib(i.bytes)}" for i in big) + ")")
        budget = "chain" if s.budget is None else s.budget
        return (f"memory plan: ctx {s.max_ctx}, budget {budget if s.speculative else 'off'}, slots {s.slots}, "
                f"KV {s.cache_type_k}/{s.cache_type_v}; " + "; ".join(parts))

    def table(self) -> str:
        """Itemised text for --plan-only."""
        s = self.settings
        lines = [f"memory plan (max_ctx {s.max_ctx}, budget "
                 f"{'chain' if s.budget is None else s.budget}{'' if s.speculative else ' (no drafter)'}, "
                 f"widest verify {self.width} tokens, slots {s.slots}, KV K={s.cache_type_k} V={s.cache_type_v})"]
        if self.shrunk_from:
            lines.append(f"  max_ctx shrunk from {self.shrunk_from} to fit")
        for d in self.devices:
            lines.append(f"  {d.device}: {_gib(d.total)} planned, {_gib(d.free)} free of {_gib(d.total_memory)}"
                         f" -> {'fits' if d.fits else 'DOES NOT FIT'}")
            for i in d.items:
                lines.append(f"    {i.name:<28} {_gib(i.bytes):>11}  {i.note}")
        return "\n".join(lines)


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= 0.1 * GiB else f"{n / MiB:.1f} MiB"


def kv_bytes_per_token(cfg: ModelConfig, cache_type_k: str, cache_type_v: str) -> float:
    """KV bytes one token of context takes over all attention layers."""
    for t in (cache_type_k, cache_type_v):
        if t not in KV_BYTES_PER_VALUE:
            raise MemoryPlanError(f"unknown KV cache type {t!r}; expected one of {', '.join(KV_BYTES_PER_VALUE)}")
    n_attn = sum(1 for r in cfg.recurrent_layers if not r)
    per_side = n_attn * cfg.n_head_kv * cfg.head_dim
    return per_side * (KV_BYTES_PER_VALUE[cache_type_k] + KV_BYTES_PER_VALUE[cache_type_v])


def kv_cache_bytes(cfg: ModelConfig, cache_type_k: str, cache_type_v: str, ctx: int, backend: str) -> int:
    """Bytes one slot's KV cache of `ctx` tokens takes as `backend` allocates it: the NumPy engine ctx rows of
    each type; the GPU (kernels/attention.py KVCacheLayer via models/qwen35_gpu.gpu_kv_type) f32 as f16 and
    the rows rounded up to whole CUDA_KV_TILE tiles."""
    k, v = cache_type_k, cache_type_v
    if backend == "cuda":
        k, v = ("f16" if t == "f32" else t for t in (k, v))
        ctx = -(-int(ctx) // CUDA_KV_TILE) * CUDA_KV_TILE
    return int(round(ctx * kv_bytes_per_token(cfg, k, v)))


def _activation_floats(cfg: ModelConfig) -> int:
    """float32 values one token keeps live inside a block: residual, norms, FFN, the wider mixer."""
    deltanet = 2 * cfg.ssm_conv_dim + 2 * cfg.ssm_inner_size if any(cfg.recurrent_layers) else 0
    attention = 4 * cfg.n_head * cfg.head_dim + 2 * cfg.n_head_kv * cfg.head_dim
    return 4 * cfg.n_embd + 3 * cfg.n_ff + max(deltanet, attention)


def _attention_scratch(backend: str, n_head: int, head_dim: int, n_kv_head: int, width: int, ctx: int,
                       kv_quantized: bool) -> int:
    if backend == "cuda":
        return width * n_head * (head_dim + 2) * 4 * CUDA_ATTN_SPLITS
    # NumPy: scores, the masked copy and the probabilities, each (heads, width, ctx) float32; quantized KV
    # is decoded to float32 for the layer being attended
    dec = 2 * ctx * n_kv_head * head_dim * 4 if kv_quantized else 0
    return 3 * n_head * width * ctx * 4 + dec


def build_plan(cfg: ModelConfig, weights: WeightBytes, s: PlanSettings, drafter: DrafterShape | None = None,
               free: dict[str, tuple[int, int]] | None = None) -> MemoryPlan:
    """The itemised plan for settings `s`; free maps str(device) -> (free, total) bytes (queried if absent)."""
    if s.max_ctx < 1:
        raise MemoryPlanError(f"max_ctx must be >= 1, got {s.max_ctx}")
    if s.slots < 1:
        raise MemoryPlanError(f"slots must be >= 1, got {s.slots}")
    tdev = s.device
    ddev = s.draft_device or tdev
    be = tdev.backend
    n = s.slots
    ctx = s.max_ctx
    block = drafter.block_size if drafter is not None else DEFAULT_BLOCK_SIZE
    width = 1 if not s.speculative else (block if s.budget is None else s.budget + 1)
    wide = max(width, min(PREFILL_CHUNK, ctx))
    n_rec = sum(1 for r in cfg.recurrent_layers if r)
    state = cfg.ssm_n_v_heads * cfg.ssm_head_k_dim * cfg.ssm_head_v_dim * 4
    tree_rows = max(width, CUDA_TREE_ROWS) if be == "cuda" else width   # per-node rows a state holds
    kv_slot = kv_cache_bytes(cfg, s.cache_type_k, s.cache_type_v, ctx, be)
    kv_note = f"{s.cache_type_k}/{s.cache_type_v}"
    if be == "cuda" and "f32" in (s.cache_type_k, s.cache_type_v):
        kv_note += ", f32 kept as f16 on the GPU"
    quantized_kv = s.cache_type_k != "f32" or s.cache_type_v != "f32"
    budget_txt = "plain decoding" if not s.speculative else (
        f"chain of {block}" if s.budget is None else f"budget {s.budget} + root")

    t_items = [
        Item("target weights", weights.resident(be),
             "stored (quantized) bytes" if be == "cuda" else "float32 (NumPy dequantizes at load), token_embd packed"),
        Item("KV cache", n * kv_slot, f"{n} slot(s) x {ctx} tokens x {kv_slot / ctx:g} B ({kv_note})"),
        *((Item("recurrent state", n * n_rec * 2 * state,
                f"{n_rec} DeltaNet layers x {state} B x 2 (committed, a chain step's final state)"),
           Item("recurrent replay inputs", n * n_rec * tree_rows * (cfg.ssm_conv_dim + 2 * cfg.ssm_n_v_heads) * 4,
                f"{tree_rows} nodes per layer x conv row + g, beta float32 (a commit replays the path; {budget_txt})"))
          if be == "cuda" else
          (Item("recurrent state", n * n_rec * state, f"{n_rec} DeltaNet layers x {state} B"),
           Item("recurrent checkpoints", n * n_rec * width * state, f"{width} per layer ({budget_txt})"))),
        Item("conv windows", n * n_rec * (cfg.ssm_conv_kernel - 1 + tree_rows) * cfg.ssm_conv_dim * 4,
             f"{cfg.ssm_conv_kernel - 1} committed + {tree_rows} tree rows x {cfg.ssm_conv_dim} float32"),
        Item("activations", n * wide * _activation_floats(cfg) * 4, f"widest pass {wide} tokens, float32"),
        Item("attention scratch", n * _attention_scratch(be, cfg.n_head, cfg.head_dim, cfg.n_head_kv, wide, ctx,
                                                         quantized_kv),
             "split-K partials" if be == "cuda" else f"softmax over {ctx} keys x {wide} queries"),
        Item("logits", n * 2 * width * cfg.n_vocab * 4, f"{width} rows x {cfg.n_vocab} x 2 float32"),
    ]
    d_items: list[Item] = []
    if drafter is not None:
        dbe = ddev.backend
        t_items.append(Item("drafter features", n * wide * drafter.n_features * 4,
                            f"captured target layers, {wide} tokens"))
        dkv = 2 if dbe == "cuda" else 4
        dact = 4 * drafter.n_embd + 3 * drafter.n_ff + 4 * drafter.n_head * drafter.head_dim + drafter.n_features
        d_items = [
            Item("drafter weights", drafter.weights.resident(dbe),
                 "stored bytes" if dbe == "cuda" else "float32 (NumPy)"),
            Item("drafter context cache", n * ctx * drafter.n_layer * 2 * drafter.n_head_kv * drafter.head_dim * dkv,
                 f"{drafter.n_layer} layers x {ctx} rows, {'f16' if dkv == 2 else 'f32'}"),
            Item("drafter activations", n * (wide * dact * 4 + _attention_scratch(
                dbe, drafter.n_head, drafter.head_dim, drafter.n_head_kv, block, ctx, False)),
                 f"context chunk {wide} / block {block}"),
            Item("drafter logits", n * 2 * (block - 1) * cfg.n_vocab * 4, f"{block - 1} rows x 2 float32"),
        ]
        if ddev != tdev:
            d_items.insert(1, Item("target embedding + head copy", weights.shared_head(dbe),
                                   "the drafter borrows the target's token_embd and output"))
    t_items.append(Item("workspace reserve", RESERVE_BYTES[tdev.kind], _RESERVE_NOTE[tdev.kind]))
    if ddev == tdev:
        per_device = {str(tdev): t_items + d_items}
    else:
        d_items.append(Item("workspace reserve", RESERVE_BYTES[ddev.kind], _RESERVE_NOTE[ddev.kind]))
        per_device = {str(tdev): t_items, str(ddev): d_items}
    free = dict(free or {})
    devices = []
    for name, items in per_device.items():
        if name not in free:
            free[name] = device_memory(parse_device(name))
        f, tot = free[name]
        devices.append(DevicePlan(name, items, f, tot))
    return MemoryPlan(settings=s, devices=devices, width=width)


_RESERVE_NOTE = {"cuda": "CUDA graphs, cuBLAS workspace, NVRTC modules, allocator slack",
                 "cpu": "interpreter, gRPC, NumPy temporaries"}
_KV_ORDER = ("f32", "f16", "q8_0", "tq3_0")    # dearest first


def _cheaper(current: str, t: str) -> str:
    return t if _KV_ORDER.index(t) > _KV_ORDER.index(current) else current


def _largest(lo: int, hi: int, ok) -> int | None:
    """Largest x in [lo, hi] with ok(x), for ok monotone (true up to some point); None if none."""
    if hi < lo or not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def plan_memory(cfg: ModelConfig, weights: WeightBytes, s: PlanSettings, drafter: DrafterShape | None = None,
                free: dict[str, tuple[int, int]] | None = None, shrink_ctx: bool = False) -> MemoryPlan:
    """A plan that fits, or MemoryPlanError naming what to change.

    shrink_ctx: max_ctx was not asked for (the model's own length): shrink it to the largest multiple of
    CTX_STEP that fits (at least MIN_AUTO_CTX) instead of refusing; plan.shrunk_from says so.
    """
    free = dict(free or {})
    plan = build_plan(cfg, weights, s, drafter, free)
    for d in plan.devices:
        free.setdefault(d.device, (d.free, d.total_memory))
    if plan.fits:
        return plan

    def fits(**kw) -> bool:
        return build_plan(cfg, weights, replace(s, **kw), drafter, free).fits

    steps = s.max_ctx // CTX_STEP
    ctx_steps = _largest(1, steps, lambda k: fits(max_ctx=k * CTX_STEP)) if steps >= 1 else None
    ctx_fit = ctx_steps * CTX_STEP if ctx_steps else None
    if ctx_fit is None and s.max_ctx > 1:
        ctx_fit = _largest(1, s.max_ctx - 1, lambda c: fits(max_ctx=c))
    if shrink_ctx and ctx_fit is not None and ctx_fit >= min(MIN_AUTO_CTX, s.max_ctx):
        shrunk = build_plan(cfg, weights, replace(s, max_ctx=ctx_fit), drafter, free)
        shrunk.shrunk_from = s.max_ctx
        return shrunk

    fixes: list[str] = []
    if ctx_fit is not None:
        fixes.append(f"--max-ctx {ctx_fit}")
    if s.speculative and s.budget is not None and s.budget > 1:
        b = _largest(1, s.budget - 1, lambda b: fits(budget=b))
        if b is not None:
            fixes.append(f"--budget {b}")
    for t in _KV_ORDER[1:]:
        k, v = _cheaper(s.cache_type_k, t), _cheaper(s.cache_type_v, t)
        if (k, v) != (s.cache_type_k, s.cache_type_v) and fits(cache_type_k=k, cache_type_v=v):
            fixes.append(f"--cache-type-k {k} --cache-type-v {v}")
            break
    if s.slots > 1 and fits(slots=1):
        fixes.append("--slots 1")
    bad = [d for d in plan.devices if not d.fits]
    need = "; ".join(
        f"{d.device} needs {_gib(d.total)} but has {_gib(d.free)} free ("
        + ", ".join(f"{i.name} {_gib(i.bytes)}" for i in sorted(d.items, key=lambda i: -i.bytes)[:4]) + ")"
        for d in bad)
    budget = "chain" if s.budget is None else s.budget
    head = (f"the model does not fit in memory at max_ctx {s.max_ctx}, budget {budget}, "
            f"KV {s.cache_type_k}/{s.cache_type_v}, {s.slots} slot(s): {need}")
    if fixes:
        raise MemoryPlanError(f"{head}. Any one of these fits: {'; '.join(fixes)}")
    floor = build_plan(cfg, weights, replace(s, max_ctx=1, budget=1 if s.budget is not None else None,
                                             cache_type_k="tq3_0", cache_type_v="tq3_0", slots=1), drafter, free)
    fixed = "; ".join(f"{d.device} {_gib(d.total)} (weights {_gib(d.get('target weights') + d.get('drafter weights'))}"
                      f", reserve {_gib(d.get('workspace reserve'))})" for d in floor.devices if not d.fits)
    raise MemoryPlanError(f"{head}. No smaller context, budget or KV type fits: even at max_ctx 1 it needs {fixed}; "
                          "use a smaller quantization, another device (--device / --draft-device) or a machine "
                          "with more memory")


# --------------------------------------------------------------------------------------------------
# from files


@dataclass
class HeaderTensor:
    name: str
    qtype: int
    shape: tuple[int, ...]     # numpy order
    nbytes: int


class SkippedArray:
    """A long metadata array the header scan did not decode (a vocabulary): only its length is kept."""

    def __init__(self, count: int):
        self.count = count

    def __len__(self) -> int:
        return self.count


SMALL_ARRAY = 4096             # metadata arrays up to this long are decoded; longer ones are only counted
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def read_gguf_header(path: str) -> tuple[dict[str, Any], dict[str, HeaderTensor]]:
    """Metadata and tensor infos of a GGUF, fast: gguf-py's reader spends about a minute on the ~500k
    strings of a Qwen3.6 vocabulary, which planning does not need. Raises ValueError on anything odd (the
    caller then lets formats.open_model_file produce the precise error)."""
    import gguf

    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        pos = 0

        def take(fmt: str) -> Any:
            nonlocal pos
            v = struct.unpack_from(fmt, buf, pos)[0]
            pos += struct.calcsize(fmt)
            return v

        def text() -> str:
            nonlocal pos
            n = take("<Q")
            if pos + n > len(buf):
                raise ValueError("string past the end of the file")
            v = bytes(buf[pos:pos + n]).decode("utf-8", errors="replace")
            pos += n
            return v

        def value(vt: int) -> Any:
            nonlocal pos
            if vt in _SCALARS:
                return take(_SCALARS[vt])
            if vt == _STRING:
                return text()
            if vt != _ARRAY:
                raise ValueError(f"value type {vt}")
            et, count = take("<I"), take("<Q")
            if count > SMALL_ARRAY:
                if et in _SCALARS:
                    pos += count * struct.calcsize(_SCALARS[et])
                else:
                    for _ in range(count):
                        value(et)
                return SkippedArray(count)
            return [value(et) for _ in range(count)]

        if bytes(buf[:4]) != b"GGUF":
            raise ValueError("no GGUF magic")
        pos = 4
        version, n_tensors, n_kv = take("<I"), take("<Q"), take("<Q")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version}")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = text()
            meta[key] = value(take("<I"))
        tensors: dict[str, HeaderTensor] = {}
        for _ in range(n_tensors):
            name = text()
            ne = [take("<Q") for _ in range(take("<I"))]
            qtype, _offset = take("<I"), take("<Q")
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
            tensors[name] = HeaderTensor(name, qtype, tuple(reversed(ne)), math.prod(ne) // block * size)
    return meta, tensors


def read_model_header(path: str) -> tuple[dict[str, Any], dict[str, Any], str]:
    """(metadata, tensors with .shape/.nbytes, kind) without reading weights; GGUF through the fast scan."""
    from .formats import KIND_GGUF, detect_format, open_model_file

    if os.path.isfile(path) and detect_format(path) == KIND_GGUF:
        try:
            meta, tensors = read_gguf_header(path)
            return meta, tensors, KIND_GGUF
        except (ValueError, KeyError, struct.error):
            pass   # open_model_file below names the file, the offset and what is wrong
    mf = open_model_file(path)
    return mf.metadata, mf.tensors, mf.kind


def plan_for_files(model: str, draft: str | None, s: PlanSettings, *, remote_drafter: bool = False,
                   shrink_ctx: bool = False, free: dict[str, tuple[int, int]] | None = None,
                   ) -> tuple[MemoryPlan, ModelConfig]:
    """Open the files' headers (memory-mapped, nothing dequantized) and plan; returns (plan, target config).

    s.max_ctx <= 0 means the model's own context length; KV types None / `auto` are resolved for the model
    (resolve_kv_types). Speculation is planned when a drafter is given
    (in-process `draft` or a remote one) unless s.speculative is False.
    """
    check_device(s.device)
    if s.draft_device is not None:
        check_device(s.draft_device)
    meta, tensors, kind = read_model_header(model)
    cfg = _target_config(model, meta, tensors, kind)
    ctx = s.max_ctx if s.max_ctx > 0 else cfg.context_length
    ctx = min(ctx, cfg.context_length)
    k, v = resolve_kv_types(cfg, s.cache_type_k, s.cache_type_v)
    d_shape = drafter_shape(draft, cfg) if draft else None
    speculative = s.speculative and (d_shape is not None or remote_drafter)
    settings = replace(s, max_ctx=ctx, cache_type_k=k, cache_type_v=v, speculative=speculative)
    return plan_memory(cfg, WeightBytes.of(tensors), settings, d_shape, free, shrink_ctx), cfg


def _target_config(path: str, meta: dict[str, Any], tensors: dict[str, Any], kind: str) -> ModelConfig:
    from .config import config_from_gguf
    from .formats import KIND_GGUF, open_model_file
    from .loader import config_of

    if kind == KIND_GGUF:
        emb = tensors.get("token_embd.weight")
        return config_from_gguf(meta, n_vocab=emb.shape[0] if emb is not None else None, path=path)
    return config_of(open_model_file(path))


def drafter_shape(path: str, cfg: ModelConfig) -> DrafterShape:
    from .formats import KIND_GGUF
    from .models.dflash import canonical_tensor_names, drafter_config_from_gguf, drafter_config_from_hf

    meta, raw, kind = read_model_header(path)
    tensors = canonical_tensor_names(raw)
    if kind == KIND_GGUF:
        fc = tensors.get("dflash_fc.weight")
        dc = drafter_config_from_gguf(meta, n_target_layer=cfg.n_layer,
                                      n_features=fc.shape[1] if fc is not None else None, path=path)
    else:
        dc = drafter_config_from_hf(meta, n_target_layer=cfg.n_layer, path=path)
    return DrafterShape(n_layer=dc.n_layer, n_embd=dc.n_embd, n_ff=dc.n_ff, n_head=dc.n_head,
                        n_head_kv=dc.n_head_kv, head_dim=dc.head_dim, block_size=dc.block_size,
                        n_features=dc.n_features, weights=WeightBytes.of(tensors))


def resolve_kv_types(cfg: ModelConfig, cache_type_k: str | None, cache_type_v: str | None,
                     default: Sequence[str] = ("f32", "f32")) -> tuple[str, str]:
    """Concrete KV types: as given, `auto` by kvcache's rule, None -> `default` (what the engine allocates)."""
    k = cache_type_k or default[0]
    v = cache_type_v or default[1]
    if "auto" in (k, v):
        from .kvcache import resolve_cache_types

        try:
            k, v = resolve_cache_types(cfg, k, v)
        except ValueError as e:
            raise MemoryPlanError(str(e)) from None
    return k, v


# --------------------------------------------------------------------------------------------------
# command-line start-up


def plan_from_args(args: Any, model: str, draft: str | None, *, remote_drafter: bool = False) -> MemoryPlan:
    """The plan for a command's parsed flags (--device, --draft-device, --max-ctx, --budget/--chain, --slots,
    --cache-type-k/v); with no --max-ctx the model's length is shrunk to fit if needed. Speculation is
    planned whenever there is a drafter: --no-speculative only sets the default a request may override."""
    dev = parse_device(getattr(args, "device", None) or "cpu")
    ddev_txt = getattr(args, "draft_device", None)
    ddev = parse_device(ddev_txt) if ddev_txt else None
    check_device(dev)
    if ddev is not None:
        check_device(ddev)
    budget = getattr(args, "budget", DEFAULT_BUDGET)
    if budget == "auto":
        from .speculative import AUTO_MAX_BUDGET

        budget = AUTO_MAX_BUDGET
    if getattr(args, "chain", False):
        budget = None
    max_ctx = getattr(args, "max_ctx", None)
    s = PlanSettings(max_ctx=max_ctx or 0, budget=budget,
                     slots=int(getattr(args, "slots", 1) or 1), cache_type_k=getattr(args, "cache_type_k", None),
                     cache_type_v=getattr(args, "cache_type_v", None), device=dev, draft_device=ddev)
    plan, _ = plan_for_files(model, draft, s, remote_drafter=remote_drafter, shrink_ctx=max_ctx is None)
    return plan


def print_plan(plan: MemoryPlan, as_json: bool, stream: Any = None) -> None:
    import json
    import sys

    out = stream if stream is not None else sys.stdout
    print(json.dumps(plan.as_dict()) if as_json else plan.table(), file=out)
