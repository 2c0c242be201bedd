"""Start-up memory plan: what the target, its caches, the drafter and the scratch of the widest pass take on
each device, checked against the device's free memory, so a request never runs the device out of memory.

Everything is computed from the model files' headers (no weights are read) and the serving settings. The widest
verify pass (serving_width) is a tree of budget + 1 tokens or a chain of block_size, whichever is wider (the
verifier caps a request's tree at it), 1 without a drafter, at most 64 tokens on a GPU. A GPU state holds steps of
GPU_PROMPT_STEP tokens whatever the verify width (state_width): a prompt's chunks replay graph steps that wide.

NumPy backend (slots run side by side, so everything per request is counted per slot): weights dequantized to
float32 at load except the packed `token_embd`; the KV cache for `max_ctx` tokens per slot at 4 / 2 / 34/32 /
14/32 bytes a value for f32 / f16 / q8_0 / tq3_0; Gated DeltaNet state, one checkpoint per verified node and the
conv windows; activations, softmax scratch over the whole context and logits of the widest pass (the 512-token
prefill chunk or the verify); the drafter's float32 weights, context cache, activations and logits.

GPU backend, mirroring what the engine allocates (services/engine/models/qwen35_gpu.py, dflash_gpu.py):
* weights as held, byte for byte (WeightBytes.of): stored (quantized) rows for the types the matmul kernel reads,
  F16 for the others, a layer's stacked matrices one per run of a storage type, rows in whole 16-row tiles and the
  kernels' read slack, vectors as float32, the token table on the device when it can be decoded there, each array
  in CuPy's 512-byte units (kernels/quant_matmul.QuantMatrix takes its upload temporaries from a pool of its own,
  so the default pool holds exactly these);
* per slot, one pooled GpuSequenceState (gpu_state_bytes: KV in whole 32-row tiles, f32 kept as f16; committed and
  final recurrent state; width checkpoints; conv windows with a prefill chunk's raw rows; the graph steps' output
  buffers: logits rows, argmax, captured layers) and one GpuDraftSession of max_ctx + a block rows
  (gpu_session_bytes). The verifier makes them at start-up (reserve_states / reserve_sessions), so a request
  allocates no state;
* per slot, the instantiated CUDA graphs: up to GRAPHS_PER_STATE step and commit graphs per state and
  GRAPHS_PER_SESSION drafter passes per session, at GRAPH_NODE_BYTES per kernel node; and the device sampler's
  workspace (kernels/sampling.SampleWorkspace, one per slot's thread, made for the serving width: gpu_sampler_bytes);
* once per device (steps run one at a time under the verifier's engine lock): the graph arena that every
  captured graph takes its temporaries from (graph_arena_bytes: the widest step, commit or drafter pass, the
  attention's split-K partials as kernels/attention.choose_splits sizes them; reserved at start-up), the eager
  scratch of a prefill chunk or of a new shape's warm-up (CuPy's pool), a request's copies of held results, and
  quant_gemv's split scratch (the wide kernel's stream-K partials: split_scratch_bytes, one buffer per stream,
  sized at start-up);
* a fixed reserve per device: RESERVE_BYTES below (CUDA context, cuBLAS workspace, NVRTC modules and allocator
  fragmentation on a GPU; interpreter, gRPC and NumPy temporaries on the CPU).

Free memory: cupy's memGetInfo on a GPU, MemAvailable from /proc/meminfo for the CPU backend. bench/memory_check.py
compares the plan with what a GPU run holds.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .config import ModelConfig
from .errors import SpecsplitError

GiB = 1 << 30
MiB = 1 << 20
POOL_UNIT = 512                # CuPy's memory pool hands out whole units of this many bytes
GPU_TABLE_TYPES = (0, 1, 8, 12)   # F32, F16, Q8_0, Q4_K: token tables the GPU engine keeps (and decodes) on the device

# bytes per cached K or V value
KV_BYTES_PER_VALUE: dict[str, float] = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32, "tq3_0": 14 / 32}
# what a device keeps aside beyond the itemised buffers (see the module docstring)
RESERVE_BYTES: dict[str, int] = {"cuda": 1 * GiB, "cpu": 512 * MiB}
PREFILL_CHUNK = 512            # generate.PREFILL_CHUNK: prompts are committed in chunks this long
CTX_STEP = 256                 # a suggested --max-ctx is a multiple of this
MIN_AUTO_CTX = 4096            # a context the planner shrinks to on its own must be at least this long
CUDA_ATTN_SPLITS = 32          # split-K partials of the GPU tree attention
CUDA_KV_TILE = 32              # kernels/attention.py KT: a GPU KV cache holds whole tiles of this many rows
DEFAULT_BLOCK_SIZE = 16
DEFAULT_CAPTURE_LAYERS = 5     # target layers a remote (unseen) drafter reads: the DFlash drafters' 5
DEFAULT_BUDGET = "auto"        # the verifier's default; planned as its largest tree (AUTO_MAX_BUDGET)


# a layer's matrices the GPU engine uploads as one (models/qwen35_gpu.py STACKS, models/dflash_gpu.py STACKS)
GPU_TARGET_STACKS = (("ffn_gate", "ffn_up"), ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha"),
                     ("attn_q", "attn_k", "attn_v"))
GPU_DRAFTER_STACKS = (("attn_k", "attn_v"), ("ffn_gate", "ffn_up"))


def _pool(n: int) -> int:
    """Bytes CuPy's pool takes for an array of n bytes."""
    return -(-int(n) // POOL_UNIT) * POOL_UNIT


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
    gpu: int | None = None          # bytes on the GPU backend (None: the stored bytes)
    embd_gpu: int = 0               # the token table's share of them
    embd_on_host: bool = False      # the GPU keeps the token table on the host (a type it cannot decode)
    mats: set[tuple[int, int, int]] = field(default_factory=set)   # the GPU's matrices: (storage type, rows, in)
    head: tuple[int, int, int] | None = None                          # the LM head's among them
    # matrices the GPU kernels cannot read as stored, which go up as F16 and grow: type name -> [stored, GPU bytes]
    f16_fallback: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def of(cls, tensors: dict[str, Any], stacks: Sequence[Sequence[str]] | None = None) -> WeightBytes:
        """The bytes of a model file's tensors; `gpu`: what the GPU engine allocates for them, byte for byte, in CuPy's
        pool: every array in whole POOL_UNIT units; the layers' stacked matrices (stacks: groups of a layer's tensor
        names, the ones models/qwen35_gpu.py and dflash_gpu.py upload as one; default: the drafter's when the file
        is a DFlash drafter, else the target's) one matrix per run of a storage type and in-width."""
        from kernels.quant_matmul import PAD_BYTES, SUPPORTED_QTYPES, TILE_ROWS
        from services.engine.quants import type_name

        if stacks is None:
            stacks = GPU_DRAFTER_STACKS if "dflash_fc.weight" in tensors else GPU_TARGET_STACKS

        def kind(t: Any) -> tuple[int, int, int]:
            """(device storage type, row bytes, in-width) of backend.GpuMatrix.of: a type the kernel lacks as F16."""
            q = int(getattr(t, "qtype", 0))
            rows, k = int(t.shape[0]), int(t.shape[1])
            return (q, int(t.nbytes) // rows, k) if q in SUPPORTED_QTYPES else (1, 2 * k, k)

        def matrix(members: list[Any]) -> int:
            """One kernels.quant_matmul.QuantMatrix of the members' rows: whole 16-row tiles, then PAD_BYTES."""
            qtype, row_bytes, k = kind(members[0])
            rows = sum(int(t.shape[0]) for t in members)
            wb.mats.add((qtype, rows, k))
            nbytes = _pool(row_bytes * _round_up(rows, TILE_ROWS) + PAD_BYTES)
            stored = sum(int(t.nbytes) for t in members)
            stored_type = int(getattr(members[0], "qtype", 0))
            if stored_type not in SUPPORTED_QTYPES and nbytes > stored:
                grown = wb.f16_fallback.setdefault(type_name(stored_type), [0, 0])
                grown[0] += stored
                grown[1] += nbytes
            return nbytes

        wb = cls(stored=0, f32=0, gpu=0)
        runs: dict[str, list[Any]] = {}       # a stacked tensor's name -> the run it belongs to
        for layer in {n.split(".")[1] for n in tensors if n.startswith("blk.")}:
            for group in stacks:
                run: list[Any] = []
                for short in group:
                    name = f"blk.{layer}.{short}.weight"
                    t = tensors.get(name)
                    if t is None:
                        continue
                    if run and kind(run[0])[::2] != kind(t)[::2]:
                        run = []
                    run.append(t)
                    runs[name] = run
        counted: set[int] = set()
        for name, t in tensors.items():
            n32 = 4 * math.prod(t.shape)
            wb.stored += int(t.nbytes)
            wb.f32 += n32
            if name == "token_embd.weight":
                wb.embd_stored, wb.embd_f32 = int(t.nbytes), n32
                # backend.GpuEmbedding keeps F32 / F16 / Q8_0 on the device, qwen35_gpu a Q4_K table too
                wb.embd_on_host = int(getattr(t, "qtype", 0)) not in GPU_TABLE_TYPES
                wb.embd_gpu = 0 if wb.embd_on_host else _pool(int(t.nbytes))
                wb.gpu += wb.embd_gpu
            elif name == "output.weight":
                wb.output_stored, wb.output_f32 = int(t.nbytes), n32
                wb.gpu += matrix([t])
                wb.head = kind(t)[0], int(t.shape[0]), int(t.shape[1])
            elif name in runs:
                if id(runs[name]) not in counted:
                    counted.add(id(runs[name]))
                    wb.gpu += matrix(runs[name])
            elif len(t.shape) == 2 and "conv1d" not in name:
                wb.gpu += matrix([t])
            else:                          # vectors (and conv taps): float32 device arrays
                wb.gpu += _pool(n32)
        wb.tied = wb.output_stored == 0
        if wb.tied and "token_embd.weight" in tensors:
            t = tensors["token_embd.weight"]
            wb.gpu += matrix([t])     # the LM head: the table again, as a matrix
            wb.head = kind(t)[0], int(t.shape[0]), int(t.shape[1])
        return wb

    def fallback_text(self) -> str:
        """What the F16 fallback costs, for the plan and a refusal ('' when nothing grows)."""
        if not self.f16_fallback:
            return ""
        from kernels.quant_matmul import SUPPORTED_QTYPES
        from services.engine.quants import type_name

        names = ", ".join(sorted(self.f16_fallback))
        stored = sum(v[0] for v in self.f16_fallback.values())
        gpu = sum(v[1] for v in self.f16_fallback.values())
        takes = ", ".join(type_name(q) for q in sorted(SUPPORTED_QTYPES))
        return (f"the {names} matrices ({_gib(stored)} stored) go to the GPU dequantized to F16 ({_gib(gpu)}): the "
                f"GPU kernels read {takes}; a file of this model in those types (Q4_K_M, Q5_K_M, Q3_K_M, Q4_0, IQ4_XS, "
                "Q8_0) keeps them at their stored size, and each step reads fewer bytes")

    def head_mats(self) -> set[tuple[int, int, int]]:
        """The LM head's matrix (what a drafter on another GPU multiplies by too), as a set of `mats`."""
        return {self.head} if self.head is not None else set()

    def resident(self, backend: str) -> int:
        """Bytes the backend keeps for the whole model."""
        if backend == "cuda":
            return self.stored if self.gpu is None else self.gpu
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
    sliding_window: int | None = None   # the sliding layers' context window (None: no windowed layer)
    n_causal: int = 0                   # sliding (causal) layers


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
    width: int                         # the widest verify (serving_width)
    state_width: int                   # the widest step a state holds (state_width)
    shrunk_from: int | None = None     # the max_ctx asked for, when the planner shrank it to fit
    warnings: list[str] = field(default_factory=list)   # what the start-up log and a refusal should say too

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
            "state_width": self.state_width,
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

    def _steps(self) -> str:
        return f" (prompt steps {self.state_width})" if self.state_width != self.width else ""

    def table(self) -> str:
        """Itemised text for --plan-only."""
        s = self.settings
        lines = [f"memory plan (max_ctx {s.max_ctx}, budget "
                 f"{'chain' if s.budget is None else s.budget}{'' if s.speculative else ' (no drafter)'}, "
                 f"widest verify {self.width} tokens{self._steps()}, slots {s.slots}, "
                 f"KV K={s.cache_type_k} V={s.cache_type_v})"]
        if self.shrunk_from:
            lines.append(f"  max_ctx shrunk from {self.shrunk_from} to fit")
        lines += [f"  note: {w}" for w in self.warnings]
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


# --------------------------------------------------------------------------------------------------
# the GPU engine's buffers (models/qwen35_gpu.py, models/dflash_gpu.py), byte for byte where they are fixed


GPU_MAX_WIDTH = 64             # the attention kernel's mask is one uint64 per token: a verify wider runs eagerly
GPU_RAW_ROWS = 512             # qwen35_gpu.RAW_ROWS: pre-conv rows a state keeps (a prefill chunk's)
GPU_ATTN_TOKENS = 64           # qwen35_gpu.ATTN_TOKENS: the step values' mask rows
GPU_PROMPT_STEP = 64           # qwen35_gpu._prompt_top: a prompt's whole chunks as graph steps of this many tokens
GPU_PROMPT_APPEND = 256        # speculative.PROMPT_APPEND_ROWS: a prompt's features go to the drafter this many at once
GPU_ARENA_SLACK = 4 << 20      # qwen35_gpu.ARENA_SLACK: an arena holds a measured peak + 1/8 + this
GPU_GRAPHS_PER_STATE = 64      # qwen35_gpu.GRAPHS_PER_STATE: step graphs, and commit graphs, a state keeps
GPU_GRAPHS_PER_SESSION = 64    # dflash_gpu.GRAPHS_PER_SESSION
GPU_MAX_APPEND = 64            # dflash_gpu.MAX_APPEND: feature rows a captured drafter pass appends
GPU_APPEND_CHUNK = 256         # dflash_gpu.append_context: a prompt's features are appended this many rows at once
GPU_TOPK = 8                   # dflash_gpu.TOPK
DEFAULT_SMS = 132              # SMs assumed when the GPU cannot be asked (an H100 SXM / H200 has 132)
# Device memory an instantiated CUDA graph keeps per kernel node (CUDA allocates it outside CuPy's pool, in 2 MiB
# pages). bench/memory_check.py on an H100 (2026-11-26): 3.2-3.8 KiB per node while a state captures a step and a
# commit graph of each new width (27B: ~870 nodes per width, the embedded pair: ~120), 6.5 KiB over a whole run of
# the embedded pair (small graphs, and the kernel modules first loaded while serving counted in). 8 KiB: 1.25x the
# largest measured figure, 2x the steady one. Node counts: qwen35_gpu's fused block is ~13 launches (27B width-1
# step: 809 nodes measured, planned 1064).
GRAPH_NODE_BYTES = 8 << 10
STEP_NODES_PER_LAYER, STEP_NODES_EXTRA = 16, 40
COMMIT_NODES_PER_ATTN_LAYER, COMMIT_NODES_EXTRA = 4, 4
DRAFT_NODES_PER_LAYER, DRAFT_NODES_EXTRA = 20, 40
SMALL_ALLOCS_PER_BLOCK = 48    # allocations of a block, each rounded up to 512 bytes by the arena
ARENA_ALIGN = 512


def serving_width(speculative: bool, budget: int | None, block: int, backend: str) -> int:
    """Tokens of the widest verify pass a server runs: 1 without a drafter; else a tree of budget + 1 or a chain of
    `block` tokens, whichever is wider (a request may ask for a chain; the verifier caps a request's tree at this
    width); on a GPU at most GPU_MAX_WIDTH, so that every verify is a captured step on the attention kernel."""
    if not speculative:
        return 1
    width = block if budget is None else max(int(budget) + 1, block)
    return min(width, GPU_MAX_WIDTH) if backend == "cuda" else width


def state_width(speculative: bool, budget: int | None, block: int, backend: str) -> int:
    """Tokens of the widest step a sequence state holds (its checkpoints, logits rows, graph steps): the verify
    width, and on a GPU at least GPU_PROMPT_STEP, so that a prompt runs as replays of 64-token graph steps whatever
    the verify width (a plain server's is 1; eager 512-token chunks are bound by the host: pp512 of the 27B 306 ms
    against 119 ms as graph replays on an H200), for ~0.2 GB a slot on the 27B."""
    width = serving_width(speculative, budget, block, backend)
    return max(width, GPU_PROMPT_STEP) if backend == "cuda" else width


def device_sms(device: Device | None = None) -> int:
    """Streaming multiprocessors of a GPU (DEFAULT_SMS when it cannot be asked)."""
    try:
        import cupy

        return int(cupy.cuda.Device(device.index if device else 0).attributes["MultiProcessorCount"])
    except Exception:  # noqa: BLE001 - no CuPy / no GPU: the planner still answers
        return DEFAULT_SMS


def _pad8(n: int) -> int:
    return -(-int(n) // 8) * 8


def _round_up(n: int, unit: int) -> int:
    return -(-int(n) // unit) * unit


def attention_splits_bound(n_head: int, n_kv_head: int, tokens: int, sms: int, head_dim: int = 0) -> int:
    """Most K splits kernels.attention.choose_splits gives `tokens` queries at any context: its split_target (a wave
    of blocks over the grid), within MAX_SPLITS and (head_dim given) the WS_CAP_BYTES workspace cap; only its floor of
    key tiles a split, which depends on the context, is left out."""
    from kernels import attention as att

    want = att.split_target(n_head, n_kv_head, tokens, sms)
    cap = att.MAX_SPLITS
    if head_dim:
        cap = min(cap, max(1, att.WS_CAP_BYTES // (n_head * tokens * (head_dim + 2) * 4)))
    return max(1, min(want, cap))


def _attn_workspace(n_head: int, n_kv_head: int, head_dim: int, tokens: int, sms: int) -> int:
    """kernels.attention.make_workspace: the splits' partial outputs and (max, sum) pairs, float32."""
    return attention_splits_bound(n_head, n_kv_head, tokens, sms, head_dim) * n_head * tokens * (head_dim + 2) * 4


def _embed_scratch(cfg: ModelConfig, T: int) -> int:
    """Device temporaries of T token rows decoded on the device (kernels.quant_matmul.embed_rows, one launch: the
    float32 (T, n_embd) rows, and the ids as int32 when a caller's were not)."""
    return T * cfg.n_embd * 4 + 4 * T


def _pack_bytes(k: int, T: int) -> int:
    """One packed activation (quant_matmul.pack_activations): fp16 rows padded to 8 tokens, and for up to
    Q16_TOKENS tokens the gemv ring kernel's int16 staging (PackedX.q16)."""
    from kernels import quant_matmul

    q16 = 4 * quant_matmul.q16_words(k, T) if T <= quant_matmul.Q16_TOKENS else 0
    return _pad8(T) * k * 2 + q16


def gpu_step_scratch(cfg: ModelConfig, T: int, sms: int) -> int:
    """Every allocation of a T-token target step (T <= 64: qwen35_gpu._block's fused launches) except its outputs,
    summed over one decoder block as if none were freed, plus the residual stream in and out, the embedded rows and
    the head's norm and argmax partials. The graph arena's first-fit placement reuses what a block frees, so its
    peak stays under this (checked on a GPU: tests/test_gpu_memory.py, bench/memory_check.py)."""
    E, F, V = cfg.n_embd, cfg.n_ff, cfg.n_vocab
    H, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
    x = T * cfg.n_embd * 4
    mixers = []
    if not all(cfg.recurrent_layers):
        # packed input, q|gate|k|v product, normed + rotated q and k, contiguous q / k / v copies, the attention's
        # split-K partials and output, the packed output rows and their projection
        mixers.append(_pack_bytes(E, T) + T * (2 * H * D + 2 * Hkv * D) * 4 + 3 * T * H * D * 4
                      + 3 * T * Hkv * D * 4 + _attn_workspace(H, Hkv, D, T, sms) + _pack_bytes(H * D, T) + x)
    if any(cfg.recurrent_layers):
        cd, Hv, dv = cfg.ssm_conv_dim, cfg.ssm_n_v_heads, cfg.ssm_head_v_dim
        # packed input, the [qkv | z | beta | alpha] product, the conv output, g and beta, the delta rule's
        # output, its packed norm * gate, the projection
        mixers.append(_pack_bytes(E, T) + T * (cd + Hv * dv + 2 * Hv) * 4 + T * cd * 4 + 2 * T * Hv * 4
                      + T * Hv * dv * 4 + _pack_bytes(Hv * dv, T) + x)
    # post-mixer pack and the new residual stream, the gate|up product, the packed SwiGLU
    ffn = _pack_bytes(E, T) + x + T * 2 * F * 4 + _pack_bytes(F, T)
    block = max(mixers) + ffn + SMALL_ALLOCS_PER_BLOCK * ARENA_ALIGN
    head = x + T * math.ceil(V / 1024) * 8
    return 2 * x + block + _embed_scratch(cfg, T) + head


def gpu_commit_scratch(cfg: ModelConfig, width: int, kv_k: str, kv_v: str) -> int:
    """A commit's temporaries (qwen35_gpu._commit_launches): the gathered K or V rows of the moved tokens."""
    from kernels import attention as att

    rb = max(att.row_bytes(gpu_kv(kv_k), cfg.head_dim), att.row_bytes(gpu_kv(kv_v), cfg.head_dim))
    return 2 * cfg.n_head_kv * width * rb + 16 * ARENA_ALIGN


def gpu_draft_scratch(cfg: ModelConfig, d: DrafterShape, sms: int, rows: int = GPU_MAX_APPEND) -> int:
    """Every allocation of one GPU drafter pass (dflash_gpu._block_pass + _head) appending `rows` feature rows: the
    append's products, one block layer's (a sliding layer reads its window in place), the embedded block and the
    head: the logits of block - 1 rows, the top-k partials, ids, log-probs."""
    B, E, F, H, Hkv, D = d.block_size, d.n_embd, d.n_ff, d.n_head, d.n_head_kv, d.head_dim
    n, P = rows, _pad8(rows)
    append = P * d.n_features * 2 + 2 * n * E * 4 + 2 * (P * E * 2 + n * 2 * Hkv * D * 4 + 2 * n * Hkv * D * 4)
    PB = _pad8(B)
    layer = (B * E * 4 + PB * E * 2 + 3 * B * H * D * 4 + B * 2 * Hkv * D * 4 + 2 * B * Hkv * D * 4
             + _attn_workspace(H, Hkv, D, B, sms) + B * H * D * 4 + PB * H * D * 2 + B * E * 4 + 2 * B * E * 4
             + PB * E * 2 + B * 2 * F * 4 + B * F * 4 + PB * F * 2 + 2 * B * E * 4)
    layer += SMALL_ALLOCS_PER_BLOCK * ARENA_ALIGN
    V, R = cfg.n_vocab, B - 1
    head = R * E * 4 + R * V * 4 + R * math.ceil(V / 1024) * (2 + 2 * GPU_TOPK) * 4 + 2 * R * GPU_TOPK * 4 \
        + R * 2 * GPU_TOPK * 4
    return append + 2 * B * E * 4 + _embed_scratch(cfg, B) + layer + head


def split_scratch_need(shapes: Iterable[tuple[int, int, int]], sms: int) -> tuple[int, int]:
    """(partial floats, counters) of kernels/quant_gemv.split_scratch that one launch on these matrices ((storage
    type, rows, in) as the GPU holds them) takes at most: the wide kernel's stream-K partials at every width it is
    dispatched at for that matrix (quant_wide.prefer_wide: from its crossover, a deep, tall or high one's own, or the
    wgmma order's, to 64 tokens: verify steps, drafter appends, and the 64-token slices of every prefill chunk),
    split-K gemv's where SPLIT_UP_TO dispatches it."""
    return _split_need(frozenset(shapes), int(sms))


@functools.lru_cache(maxsize=32)
def _split_need(shapes: frozenset[tuple[int, int, int]], sms: int) -> tuple[int, int]:
    from kernels import quant_gemv, quant_wide

    part, counters = quant_gemv.split_scratch_need(sms)
    for qtype, n_out, k in shapes:
        for tokens in range(1, quant_wide.MAX_TOKENS + 1):
            if not any(quant_wide.prefer_wide(qtype, tokens, n_out, k, order) for order in (0, 1)):
                continue
            p, c = quant_wide.scratch_need(qtype, n_out, k, tokens, sms)
            part, counters = max(part, p), max(counters, c)
    return part, counters


def split_scratch_bytes(shapes: Iterable[tuple[int, int, int]], streams: int, sms: int) -> int:
    """What quant_gemv's split scratch holds on a device once the verifier reserved split_scratch_need
    (quant_gemv.reserve_split_scratch): one buffer per stream that launches products (the eager one, the target's
    capture stream, a GPU drafter's), each at least quant_gemv.SCRATCH_FIRST, never grown."""
    from kernels import quant_gemv

    part, counters = split_scratch_need(shapes, sms)
    if not part and not counters:
        return 0
    first_p, first_c = quant_gemv.SCRATCH_FIRST
    return streams * 4 * (max(part, first_p) + max(counters, first_c))


def graph_arena_bytes(cfg: ModelConfig, width: int, kv_k: str, kv_v: str, drafter: DrafterShape | None,
                      sms: int) -> int:
    """The device's one graph arena (qwen35_gpu.GraphArena): the largest capture's need - a target step of up to
    `width` tokens, a commit, a drafter pass - with the arena's slack."""
    peak = max(max(gpu_step_scratch(cfg, t, sms) for t in range(1, min(width, GPU_MAX_WIDTH) + 1)),
               gpu_commit_scratch(cfg, width, kv_k, kv_v),
               gpu_draft_scratch(cfg, drafter, sms) if drafter is not None else 0)
    return _round_up(peak + peak // 8 + GPU_ARENA_SLACK, 1 << 20)


def gpu_eager_scratch(cfg: ModelConfig, chunk: int, n_capture: int, sms: int) -> int:
    """The temporaries of an eager target pass of `chunk` tokens (a prefill chunk: qwen35_gpu._block's separate
    launches, products in 64-token slices, attention in 64-query blocks), with its captured rows and last logits."""
    E, F, V = cfg.n_embd, cfg.n_ff, cfg.n_vocab
    H, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
    C, x = chunk, chunk * cfg.n_embd * 4
    slice_pack = 64 * max(E, F, H * D, cfg.ssm_inner_size or 0) * 2
    mixers = []
    if not all(cfg.recurrent_layers):
        mixers.append(C * (2 * H * D + 2 * Hkv * D) * 4 + 3 * C * H * D * 4 + 3 * C * Hkv * D * 4
                      + 64 * H * D * 4 * 2 + _attn_workspace(H, Hkv, D, min(C, 64), sms) + x)
    if any(cfg.recurrent_layers):
        cd, Hv, dv = cfg.ssm_conv_dim, cfg.ssm_n_v_heads, cfg.ssm_head_v_dim
        mixers.append(C * (cd + Hv * dv + 2 * Hv) * 4 + C * cd * 4 + 2 * C * Hv * 4 + 2 * C * Hv * dv * 4 + x)
    block = x + max(mixers) + 2 * x + C * 2 * F * 4 + C * F * 4 + 2 * x + slice_pack \
        + SMALL_ALLOCS_PER_BLOCK * ARENA_ALIGN
    head = E * 4 + V * 4 + math.ceil(V / 1024) * 8
    return 2 * x + block + _embed_scratch(cfg, C) + C * n_capture * E * 4 + C * 8 + head


def gpu_draft_append_scratch(d: DrafterShape, rows: int = GPU_APPEND_CHUNK) -> int:
    """dflash_gpu.append_context's temporaries for one chunk of a prompt's feature rows."""
    E, Hkv, D, P = d.n_embd, d.n_head_kv, d.head_dim, _pad8(min(rows, 64))
    return (rows * d.n_features * 4 + P * d.n_features * 2 + 2 * rows * E * 4 + rows * 4
            + 2 * (P * E * 2 + rows * 2 * Hkv * D * 4 + 2 * rows * Hkv * D * 4))


def gpu_kv(kind: str) -> str:
    """qwen35_gpu.gpu_kv_type: f32 is kept as f16."""
    return "f16" if kind == "f32" else kind


def gpu_state_bytes(cfg: ModelConfig, max_ctx: int, kv_k: str, kv_v: str, max_tree: int, n_capture: int,
                    host_rows: bool = False) -> dict[str, int]:
    """What one qwen35_gpu.GpuSequenceState holds, by part (GpuSequenceState.nbytes is their sum)."""
    L = sum(1 for r in cfg.recurrent_layers if r)
    n_attn = len(cfg.recurrent_layers) - L
    st = cfg.ssm_n_v_heads * cfg.ssm_head_k_dim * cfg.ssm_head_v_dim * 4
    cd = cfg.ssm_conv_dim

    def span(n: int, itemsize: int) -> int:       # _StepValues: each field padded to 256 bytes
        return _round_up(n * itemsize, 256)

    # tokens, positions, parents; s_len, swap; the mask rows; the embedded rows when the token table is on the host
    stage = 3 * span(max_tree, 4) + 2 * span(1, 4) + span(GPU_ATTN_TOKENS, 8)
    stage += max_tree * cfg.n_embd * 4 if host_rows else 0
    return {
        "KV cache": kv_cache_bytes(cfg, kv_k, kv_v, max_ctx, "cuda"),
        "recurrent state": 2 * L * st,            # a ping-pong pair: the committed half, a chain's final state
        # no per-node states: each node's conv output row and g, beta, which a commit replays (docs/gpu_deltanet.md)
        "recurrent replay inputs": (L * max_tree * (cd + 2 * cfg.ssm_n_v_heads) * 4 + max_tree * 4) if L else 0,
        "conv windows": L * ((cfg.ssm_conv_kernel - 1) + max(max_tree, GPU_RAW_ROWS)) * cd * 4 if L else 0,
        "step outputs": max_tree * cfg.n_vocab * 4 + 2 * max_tree * 4 + max_tree * n_capture * cfg.n_embd * 4,
        "step values": stage + 16 + 2 * 8 * max_tree,
        # kernels.attention.KVRowMover's tables: a pointer and a row width per K and V buffer
        "KV row mover": 2 * n_attn * (8 + 4),
        # kernels.attention.decode_attention's arrival counters (KVCacheLayer.counters): a word per query head slot
        "KV decode counters": n_attn * cfg.n_head_kv * _decode_group_slots() * 4,
    }


def _decode_group_slots() -> int:
    from kernels import attention as att

    return att.DECODE_MAX_GROUP


def gpu_sampler_bytes(rows: int, n_vocab: int, window: int) -> int:
    """What one kernels/sampling.SampleWorkspace holds (a slot's thread keeps one: sampled draws of a request), made
    for `rows` draws (the verify width: every node of a tree is drawn at once) over n_vocab values, each array in
    whole pool units: histograms, per-chunk masses, a float32 copy of every row when penalties apply, and the
    upload buffer of a penalty window of `window` tokens plus each row's path (at most `rows` tokens)."""
    from kernels import sampling as smp

    r, n = int(rows), int(n_vocab)
    nch = -(-n // smp.CHUNK)
    arrays = (r * 2 * nch * 4, r * smp.STATE_BYTES, r * smp.NB * 4, r * smp.NB * 8, r * smp.NB * 8, r * 4,
              r * nch * 8, r * nch * 4, r * 4, r * n * 4)
    upload = 8 * r + _round_up(r * smp.RIN * 4, 8) + 4 * (window + r * r)
    return sum(_pool(a) for a in arrays) + _pool(max(4096, 2 * upload))


def gpu_session_bytes(d: DrafterShape, rows: int, host_rows: bool = False) -> dict[str, int]:
    """What one dflash_gpu.GpuDraftSession of `rows` context rows holds (GpuDraftSession.nbytes is the sum)."""
    B = d.block_size
    kv = d.n_layer * 2 * d.n_head_kv * _round_up(rows, CUDA_KV_TILE) * d.head_dim * 2
    vals = _round_up(4 * (2 + GPU_MAX_APPEND + 2 * B), 256) + (B * 4 * d.n_embd if host_rows else 0)
    other = vals + GPU_MAX_APPEND * d.n_features * 4
    return {"drafter context cache": kv, "drafter session buffers": other}


def graph_nodes(cfg: ModelConfig, drafter: DrafterShape | None) -> tuple[int, int, int]:
    """Estimated kernel nodes of a captured (target step, commit, drafter pass)."""
    n_attn = sum(1 for r in cfg.recurrent_layers if not r)
    step = STEP_NODES_PER_LAYER * cfg.n_layer + STEP_NODES_EXTRA
    commit = COMMIT_NODES_PER_ATTN_LAYER * n_attn + COMMIT_NODES_EXTRA
    draft = 0
    if drafter is not None:
        draft = DRAFT_NODES_PER_LAYER * drafter.n_layer + DRAFT_NODES_EXTRA
    return step, commit, draft


def build_plan(cfg: ModelConfig, weights: WeightBytes, s: PlanSettings, drafter: DrafterShape | None = None,
               free: dict[str, tuple[int, int]] | None = None, sms: int | None = None) -> MemoryPlan:
    """The itemised plan for settings `s`; free maps str(device) -> (free, total) bytes (queried if absent);
    sms: the GPU's streaming multiprocessors (asked when None: they size the attention's split-K partials)."""
    if s.max_ctx < 1:
        raise MemoryPlanError(f"max_ctx must be >= 1, got {s.max_ctx}")
    if s.slots < 1:
        raise MemoryPlanError(f"slots must be >= 1, got {s.slots}")
    tdev = s.device
    ddev = s.draft_device or tdev
    be = tdev.backend
    block = drafter.block_size if drafter is not None else DEFAULT_BLOCK_SIZE
    width = serving_width(s.speculative, s.budget, block, be)
    swidth = state_width(s.speculative, s.budget, block, be)
    n_capture = 0
    if s.speculative:
        n_capture = drafter.n_features // cfg.n_embd if drafter is not None else DEFAULT_CAPTURE_LAYERS
    if be == "cuda":
        sms = sms or device_sms(tdev)
        t_items = _gpu_target_items(cfg, weights, s, width, swidth, n_capture, drafter if ddev == tdev else None,
                                    sms)
    else:
        t_items = _cpu_target_items(cfg, weights, s, width, block, drafter)
    d_items: list[Item] = []
    if drafter is not None:
        if ddev.backend == "cuda":
            d_items = _gpu_drafter_items(cfg, drafter, s, width)
            if ddev != tdev:    # its own device: its own arena, graphs and split scratch
                d_items += _own_gpu_drafter_items(cfg, weights, drafter, sms or device_sms(ddev))
        else:
            d_items = _cpu_drafter_items(cfg, drafter, s, width, block)
        if ddev != tdev:
            d_items.insert(1, Item("target embedding + head copy", weights.shared_head(ddev.backend),
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
    warnings = []
    if be == "cuda" and weights.f16_fallback:
        warnings.append(f"target: {weights.fallback_text()}")
    if drafter is not None and ddev.backend == "cuda" and drafter.weights.f16_fallback:
        warnings.append(f"drafter: {drafter.weights.fallback_text()}")
    return MemoryPlan(settings=s, devices=devices, width=width, state_width=swidth, warnings=warnings)


def _budget_text(s: PlanSettings, block: int) -> str:
    if not s.speculative:
        return "plain decoding"
    return f"chain of {block}" if s.budget is None else f"budget {s.budget} + root, or a chain of {block}"


def _cpu_target_items(cfg: ModelConfig, weights: WeightBytes, s: PlanSettings, width: int, block: int,
                      drafter: DrafterShape | None) -> list[Item]:
    """The NumPy engine: slots run side by side, so every per-request buffer is counted per slot."""
    n, ctx = s.slots, s.max_ctx
    wide = max(width, min(PREFILL_CHUNK, ctx))
    n_rec = sum(1 for r in cfg.recurrent_layers if r)
    state = cfg.ssm_n_v_heads * cfg.ssm_head_k_dim * cfg.ssm_head_v_dim * 4
    kv_slot = kv_cache_bytes(cfg, s.cache_type_k, s.cache_type_v, ctx, "numpy")
    quantized_kv = s.cache_type_k != "f32" or s.cache_type_v != "f32"
    items = [
        Item("target weights", weights.resident("numpy"), "float32 (NumPy dequantizes at load), token_embd packed"),
        Item("KV cache", n * kv_slot, f"{n} slot(s) x {ctx} tokens x {kv_slot / ctx:g} B "
                                      f"({s.cache_type_k}/{s.cache_type_v})"),
        Item("recurrent state", n * n_rec * state, f"{n_rec} DeltaNet layers x {state} B"),
        Item("recurrent checkpoints", n * n_rec * width * state, f"{width} per layer ({_budget_text(s, block)})"),
        Item("conv windows", n * n_rec * (cfg.ssm_conv_kernel - 1 + width) * cfg.ssm_conv_dim * 4,
             f"{cfg.ssm_conv_kernel - 1} committed + {width} tree rows x {cfg.ssm_conv_dim} float32"),
        Item("activations", n * wide * _activation_floats(cfg) * 4, f"widest pass {wide} tokens, float32"),
        Item("attention scratch", n * _attention_scratch("numpy", cfg.n_head, cfg.head_dim, cfg.n_head_kv, wide,
                                                         ctx, quantized_kv),
             f"softmax over {ctx} keys x {wide} queries"),
        Item("logits", n * 2 * width * cfg.n_vocab * 4, f"{width} rows x {cfg.n_vocab} x 2 float32"),
    ]
    if drafter is not None:
        items.append(Item("drafter features", n * wide * drafter.n_features * 4,
                          f"captured target layers, {wide} tokens"))
    return items


def _cpu_drafter_items(cfg: ModelConfig, d: DrafterShape, s: PlanSettings, width: int, block: int) -> list[Item]:
    n, ctx = s.slots, s.max_ctx
    wide = max(width, min(PREFILL_CHUNK, ctx))
    dact = 4 * d.n_embd + 3 * d.n_ff + 4 * d.n_head * d.head_dim + d.n_features
    return [
        Item("drafter weights", d.weights.resident("numpy"), "float32 (NumPy)"),
        Item("drafter context cache", n * ctx * d.n_layer * 2 * d.n_head_kv * d.head_dim * 4,
             f"{d.n_layer} layers x {ctx} rows, f32"),
        Item("drafter activations", n * (wide * dact * 4 + _attention_scratch(
            "numpy", d.n_head, d.head_dim, d.n_head_kv, block, ctx, False)), f"context chunk {wide} / block {block}"),
        Item("drafter logits", n * 2 * (block - 1) * cfg.n_vocab * 4, f"{block - 1} rows x 2 float32"),
    ]


def _gpu_target_items(cfg: ModelConfig, weights: WeightBytes, s: PlanSettings, width: int, swidth: int,
                      n_capture: int, drafter: DrafterShape | None, sms: int) -> list[Item]:
    """The GPU engine: per slot what one pooled GpuSequenceState holds (the verifier makes them at start-up), for
    steps of swidth tokens (state_width: verifies of up to `width`, a prompt's graph steps); once per device what
    the steps share (they run one at a time under the verifier's engine lock): the graph arena, the eager pass's
    temporaries, a request's copies; and the instantiated graphs of every slot."""
    n, ctx = s.slots, s.max_ctx
    kv_k, kv_v = gpu_kv(s.cache_type_k), gpu_kv(s.cache_type_v)
    st = gpu_state_bytes(cfg, ctx, kv_k, kv_v, swidth, n_capture, weights.embd_on_host)
    kv_note = f"{s.cache_type_k}/{s.cache_type_v}" + (
        ", f32 kept as f16 on the GPU" if "f32" in (s.cache_type_k, s.cache_type_v) else "")
    n_rec = sum(1 for r in cfg.recurrent_layers if r)
    block = drafter.block_size if drafter is not None else DEFAULT_BLOCK_SIZE
    arena = graph_arena_bytes(cfg, swidth, kv_k, kv_v, drafter, sms)
    step_nodes, commit_nodes, _ = graph_nodes(cfg, None)
    graphs = n * GPU_GRAPHS_PER_STATE * (step_nodes + commit_nodes) * GRAPH_NODE_BYTES
    eager = max(gpu_eager_scratch(cfg, min(PREFILL_CHUNK, ctx), n_capture, sms),
                arena,       # a new shape's warm-up runs eagerly, its temporaries from the pool
                gpu_draft_append_scratch(drafter) if drafter is not None else 0)
    # a result still held when its state's next graph step runs is copied (DeviceLogits / DeviceRows._detach);
    # the accepted path's features are gathered, features wait while --budget auto pauses the drafter, and a
    # prompt's wait for an append of GPU_PROMPT_APPEND rows (each concatenation a new array beside the last)
    feat_rows = max(64 + swidth, GPU_PROMPT_APPEND + GPU_PROMPT_STEP) * n_capture * cfg.n_embd * 4
    request = swidth * cfg.n_vocab * 4 + swidth * n_capture * cfg.n_embd * 4 + 2 * feat_rows
    items = [
        Item("target weights", weights.resident("cuda"),
             "stored (quantized) bytes; F16 for matrix types the kernel lacks, vectors float32"),
        Item("KV cache", n * st["KV cache"], f"{n} slot(s) x {ctx} tokens x {kv_bytes_per_token(cfg, kv_k, kv_v):g} B,"
                                             f" whole 32-row tiles ({kv_note})"),
        Item("recurrent state", n * st["recurrent state"], f"{n_rec} DeltaNet layers x 2 (a ping-pong pair)"),
        Item("recurrent replay inputs", n * st["recurrent replay inputs"],
             f"{swidth} nodes per layer x conv row + g, beta float32, no per-node states (a commit replays the "
             f"accepted path; {_budget_text(s, block)}{', at most 64 on the GPU' if s.speculative else ''}"
             f"{f'; {swidth}-token prompt steps' if swidth > width else ''})"),
        Item("conv windows", n * st["conv windows"],
             f"{cfg.ssm_conv_kernel - 1} committed + {max(swidth, GPU_RAW_ROWS)} raw rows x {cfg.ssm_conv_dim} "
             "float32"),
        Item("step outputs", n * (st["step outputs"] + st["step values"]),
             f"{swidth} logits rows x {cfg.n_vocab}, {n_capture} captured layers, step values"),
        Item("graph arena", arena, f"one for every captured graph (widest: {swidth}-token step"
                                   f"{', drafter pass' if drafter is not None else ''}), {sms} SMs"),
        Item("CUDA graphs", graphs, f"{n} slot(s) x {GPU_GRAPHS_PER_STATE} steps of ~{step_nodes} + "
                                    f"{GPU_GRAPHS_PER_STATE} commits of ~{commit_nodes} nodes x "
                                    f"{GRAPH_NODE_BYTES >> 10} KiB"),
        Item("eager pass scratch", eager, f"a {min(PREFILL_CHUNK, ctx)}-token prefill chunk, or a new shape's warm-up"),
        Item("request copies", request, "held results copied before a replay, the accepted path's features"),
        Item("device sampler", n * gpu_sampler_bytes(width, cfg.n_vocab, ctx),
             f"{n} slot(s) x sampled draws of {width} rows: histograms, penalised float32 rows"),
    ]
    streams = 3 if drafter is not None else 2
    split = split_scratch_bytes(weights.mats | (drafter.weights.mats if drafter is not None else set()), streams, sms)
    if split:
        items.append(Item("split-K scratch", split, f"wide kernel partials, {streams} streams (eager, target graphs"
                                                     f"{', drafter graphs' if drafter is not None else ''})"))
    return items


def _gpu_drafter_items(cfg: ModelConfig, d: DrafterShape, s: PlanSettings, width: int) -> list[Item]:
    """The GPU drafter: its weights, per slot one pooled GpuDraftSession of the serving context (the verifier makes
    them at start-up) and its graphs; its passes' temporaries are in the target's graph arena."""
    n, ctx = s.slots, s.max_ctx
    rows = ctx + d.block_size
    ses = gpu_session_bytes(d, rows)
    _, _, draft_nodes = graph_nodes(cfg, d)
    return [
        Item("drafter weights", d.weights.resident("cuda") + 2 * _pool(8 * d.block_size),
             "stored bytes (F16 for BF16 / F32 matrices), vectors float32, the block's two attention masks"),
        Item("drafter context cache", n * ses["drafter context cache"],
             f"{n} slot(s) x {d.n_layer} layers x {rows} rows, f16"),
        Item("drafter session buffers", n * ses["drafter session buffers"],
             "pass values, appended features"),
        Item("drafter CUDA graphs", n * GPU_GRAPHS_PER_SESSION * draft_nodes * GRAPH_NODE_BYTES,
             f"{n} slot(s) x {GPU_GRAPHS_PER_SESSION} passes of ~{draft_nodes} nodes"),
    ]


def _own_gpu_drafter_items(cfg: ModelConfig, weights: WeightBytes, d: DrafterShape, sms: int) -> list[Item]:
    """A GPU drafter on a device of its own: the graph arena and split scratch its passes use there."""
    items = [Item("graph arena", graph_arena_bytes(cfg, 1, "f16", "f16", d, sms), "the drafter's captured passes")]
    split = split_scratch_bytes(d.weights.mats | weights.head_mats(), 2, sms)
    if split:
        items.append(Item("split-K scratch", split, "wide kernel partials, 2 streams (eager, drafter graphs)"))
    return items


def drafter_service_items(cfg: ModelConfig, weights: WeightBytes, d: DrafterShape, sessions: int, max_ctx: int,
                          sms: int) -> list[Item]:
    """The drafter service (`specsplit drafter --device cuda:N`): its weights, a copy of the target's token table
    and LM head, `sessions` pooled sessions of max_ctx context rows (made at start-up), its graphs, arena and split
    scratch, and the device's workspace reserve."""
    s = PlanSettings(max_ctx=max_ctx, slots=sessions, device=Device("cuda", 0))
    items = _gpu_drafter_items(cfg, d, s, d.block_size)
    items.insert(1, Item("target embedding + head copy", weights.shared_head("cuda"),
                         "the drafter borrows the target's token_embd and output"))
    items += _own_gpu_drafter_items(cfg, weights, d, sms)
    items.append(Item("workspace reserve", RESERVE_BYTES["cuda"], _RESERVE_NOTE["cuda"]))
    return items


def plan_drafter_service(model: str, draft: str, device: Device, sessions: int, max_ctx: int | None,
                         free: tuple[int, int] | None = None, sms: int | None = None) -> tuple[MemoryPlan, Any]:
    """(plan, drafter shape) of a drafter service on a GPU, from the files' headers: `sessions` sessions of max_ctx
    context rows (None: the target's context length, shrunk to the largest multiple of CTX_STEP that fits, at least
    MIN_AUTO_CTX). MemoryPlanError naming --max-ctx / --max-sessions when it does not fit."""
    check_device(device)
    meta, tensors, kind = read_model_header(model)
    cfg = _target_config(model, meta, tensors, kind)
    d = drafter_shape(draft, cfg)
    weights = WeightBytes.of(tensors)
    f, tot = free if free is not None else device_memory(device)
    sms = sms or device_sms(device)
    ctx = min(max_ctx or cfg.context_length, cfg.context_length)

    def plan(c: int, n: int = sessions) -> MemoryPlan:
        s = PlanSettings(max_ctx=c, slots=n, device=Device("cpu"), draft_device=device)
        warn = [f"drafter: {d.weights.fallback_text()}"] if d.weights.f16_fallback else []
        return MemoryPlan(settings=s, width=d.block_size, state_width=d.block_size, warnings=warn,
                          devices=[DevicePlan(str(device), drafter_service_items(cfg, weights, d, n, c, sms), f, tot)])

    p = plan(ctx)
    if p.fits:
        return p, d
    fit = _largest_ctx(ctx, lambda c: plan(c).fits)
    if max_ctx is None and fit is not None and fit >= min(MIN_AUTO_CTX, ctx):
        shrunk = plan(fit)
        shrunk.shrunk_from = ctx
        return shrunk, d
    fixes = [f"--max-ctx {fit}"] if fit is not None else []
    if sessions > 1:
        n = _largest(1, sessions - 1, lambda n: plan(ctx, n).fits)
        if n is not None:
            fixes.append(f"--max-sessions {n}")
    head = f"the drafter does not fit in memory with {sessions} session(s) of max_ctx {ctx}: {_need_text(p.devices[0])}"
    also = "".join(f". Note: {w}" for w in p.warnings)
    if fixes:
        raise MemoryPlanError(f"{head}. Any one of these fits: {'; '.join(fixes)}{also}")
    raise MemoryPlanError(f"{head}. No smaller context or session count fits: run the drafter on the CPU "
                          f"(--device cpu) or on a device with more memory{also}")


_RESERVE_NOTE = {"cuda": "CUDA context, NVRTC modules, allocator fragmentation",
                 "cpu": "interpreter, gRPC, NumPy temporaries"}
_KV_ORDER = ("f32", "f16", "q8_0", "tq3_0")    # dearest first


def _cheaper(current: str, t: str) -> str:
    return t if _KV_ORDER.index(t) > _KV_ORDER.index(current) else current


def _largest_ctx(ctx: int, fits) -> int | None:
    """The largest context below `ctx` with fits(c): a multiple of CTX_STEP (a context to suggest), else any."""
    steps = ctx // CTX_STEP
    k = _largest(1, steps, lambda k: fits(k * CTX_STEP)) if steps >= 1 else None
    if k:
        return k * CTX_STEP
    return _largest(1, ctx - 1, fits) if ctx > 1 else None


def _need_text(d: DevicePlan) -> str:
    """'cuda:0 needs X but has Y free (its four largest items)' for a refusal."""
    big = sorted(d.items, key=lambda i: -i.bytes)[:4]
    return (f"{d.device} needs {_gib(d.total)} but has {_gib(d.free)} free ("
            + ", ".join(f"{i.name} {_gib(i.bytes)}" for i in big) + ")")


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
                free: dict[str, tuple[int, int]] | None = None, shrink_ctx: bool = False,
                sms: int | None = None) -> MemoryPlan:
    """A plan that fits, or MemoryPlanError naming what to change.

    shrink_ctx: max_ctx was not asked for (the model's own length): shrink it to the largest multiple of
    CTX_STEP that fits (at least MIN_AUTO_CTX) instead of refusing; plan.shrunk_from says so.
    """
    free = dict(free or {})
    sms = sms or (device_sms(s.device) if s.device.kind == "cuda" else None)
    plan = build_plan(cfg, weights, s, drafter, free, sms)
    for d in plan.devices:
        free.setdefault(d.device, (d.free, d.total_memory))
    if plan.fits:
        return plan

    def fits(**kw) -> bool:
        return build_plan(cfg, weights, replace(s, **kw), drafter, free, sms).fits

    ctx_fit = _largest_ctx(s.max_ctx, lambda c: fits(max_ctx=c))
    if shrink_ctx and ctx_fit is not None and ctx_fit >= min(MIN_AUTO_CTX, s.max_ctx):
        shrunk = build_plan(cfg, weights, replace(s, max_ctx=ctx_fit), drafter, free, sms)
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
    need = "; ".join(_need_text(d) for d in plan.devices if not d.fits)
    budget = "chain" if s.budget is None else s.budget
    head = (f"the model does not fit in memory at max_ctx {s.max_ctx}, budget {budget}, "
            f"KV {s.cache_type_k}/{s.cache_type_v}, {s.slots} slot(s): {need}")
    also = "".join(f". Note: {w}" for w in plan.warnings)
    if fixes:
        raise MemoryPlanError(f"{head}. Any one of these fits: {'; '.join(fixes)}{also}")
    floor = build_plan(cfg, weights, replace(s, max_ctx=1, budget=1 if s.budget is not None else None,
                                             cache_type_k="tq3_0", cache_type_v="tq3_0", slots=1), drafter, free, sms)
    fixed = "; ".join(f"{d.device} {_gib(d.total)} (weights {_gib(d.get('target weights') + d.get('drafter weights'))}"
                      f", reserve {_gib(d.get('workspace reserve'))})" for d in floor.devices if not d.fits)
    smaller = "a file in the types the GPU kernels read" if plan.warnings else "a smaller quantization"
    raise MemoryPlanError(f"{head}. No smaller context, budget or KV type fits: even at max_ctx 1 it needs {fixed}; "
                          f"use {smaller}, another device (--device / --draft-device) or a machine with more "
                          f"memory{also}")


# --------------------------------------------------------------------------------------------------
# from files


def read_model_header(path: str) -> tuple[dict[str, Any], dict[str, Any], str]:
    """(metadata, tensors with .shape/.nbytes, kind) without reading weights (formats' header walk: memory-mapped,
    nothing dequantized, under a second for a Qwen3.6 vocabulary)."""
    from .formats import open_model_file

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
    return drafter_shape_of(dc, WeightBytes.of(tensors))


def drafter_shape_of(dc: Any, weights: WeightBytes | None = None) -> DrafterShape:
    """The planner's view of a models.dflash.DrafterConfig (weights: its files' bytes, when known)."""
    n_causal = sum(1 for c in dc.layer_causal if c)
    return DrafterShape(n_layer=dc.n_layer, n_embd=dc.n_embd, n_ff=dc.n_ff, n_head=dc.n_head,
                        n_head_kv=dc.n_head_kv, head_dim=dc.head_dim, block_size=dc.block_size,
                        n_features=dc.n_features, weights=weights or WeightBytes(0, 0),
                        sliding_window=dc.sliding_window if n_causal else None, n_causal=n_causal)


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
