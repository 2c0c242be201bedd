"""Where the target and the drafter run: load them on the devices the flags name ('cpu', 'cuda:N'), and take
what serving them needs.

One place for what `specsplit generate`, the verifier service and `serve` do alike: a GPU target is a
Qwen35GpuModel (models/qwen35_gpu.py); its in-process drafter runs beside it on the same GPU
(models/dflash_gpu.py, sharing the target's token table and LM head) or on the CPU (fed host copies of the
target's features and its head); a CPU target keeps everything in NumPy. reserve_serving takes, on a GPU, what the
memory plan counts per slot and per device before the first request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import SpecsplitError
from .memory_plan import parse_device


@dataclass
class LoadedDrafter:
    """An in-process drafter and how to make one request's proposer for it."""

    drafter: Any
    device: str
    new_proposer: Callable[[], Any]


def is_gpu(device: str | None) -> bool:
    return device is not None and parse_device(device).kind == "cuda"


def check_devices(device: str, draft_device: str | None) -> str:
    """The drafter's device (default: the target's), or SpecsplitError for a pairing the engine cannot run."""
    ddev = str(draft_device) if draft_device is not None else str(device)
    tdev = parse_device(device)
    dd = parse_device(ddev)
    if dd.kind == "cuda" and tdev.kind != "cuda":
        raise SpecsplitError(f"--draft-device {ddev} with --device {device}: a GPU drafter needs its target on the "
                             "same GPU so far (--device cuda:N, or --draft-device cpu)")
    if dd.kind == "cuda" and dd.index != tdev.index:
        raise SpecsplitError(f"--draft-device {ddev} with --device {device}: an in-process drafter on another GPU "
                             f"than its target is not supported (it shares the target's token table and LM head); "
                             f"use --draft-device {tdev} or cpu, or run the drafter service on that GPU "
                             f"(`specsplit drafter --device {ddev} ...`) and point the verifier at it (--drafter)")
    return str(dd)


def load_target_on(path: str, device: str = "cpu", with_tokenizer: bool = True):
    """loader.load_target on `device`: a LoadedTarget whose model runs there."""
    if is_gpu(device):
        from .models.qwen35_gpu import load_gpu_target

        try:
            return load_gpu_target(path, parse_device(device).index, with_tokenizer=with_tokenizer)
        except ValueError as e:      # e.g. an architecture the GPU forward does not run
            raise SpecsplitError(str(e)) from None
    from .loader import load_target

    return load_target(path, with_tokenizer=with_tokenizer)


def load_drafter_on(path: str, target_model: Any, device: str) -> LoadedDrafter:
    """The DFlash drafter at `path` for `target_model`, on `device` (checked with check_devices first)."""
    from .speculative import LocalProposer

    on_gpu_target = getattr(getattr(target_model, "be", None), "name", "numpy") == "cuda"
    if is_gpu(device):
        from .models.dflash_gpu import GpuProposer, load_gpu_drafter

        dr = load_gpu_drafter(path, target_model, parse_device(device).index)
        return LoadedDrafter(dr, str(parse_device(device)), lambda: GpuProposer(dr))
    from .models.dflash import load_drafter

    if on_gpu_target:                # a CPU drafter reads the target's token table and LM head from host copies
        from .backend import NumpyBackend

        dr = load_drafter(path, target_model.host_head(), NumpyBackend())
    else:
        dr = load_drafter(path, target_model)
    return LoadedDrafter(dr, "cpu", lambda: LocalProposer(dr))


def gpu_matrices(*models: Any) -> set[tuple[int, int, int]]:
    """(storage type, rows, in) of every matrix the GPU models hold (memory_plan.WeightBytes.mats counts the same
    from the files): LM head, a drafter's fc, the layers' matrices (a stack's runs each)."""
    from .backend import GpuMatrix, GpuStack

    out: set[tuple[int, int, int]] = set()
    for m in models:
        if m is None:
            continue
        held = [getattr(m, "output", None), getattr(m, "fc", None)]
        held += [v for w in getattr(m, "layers", []) for v in w.values()]
        for v in held:
            for g in (v.mats if isinstance(v, GpuStack) else [v]):
                if isinstance(g, GpuMatrix):
                    out.add((g.qtype, int(g.shape[0]), int(g.shape[1])))
    return out


def reserve_serving(model: Any, drafter: Any, slots: int, max_ctx: int, budget: int | None, speculative: bool,
                    n_capture: int, device: str, layer_ids: Sequence[int] | None = None) -> int:
    """Set up `model` (and an in-process `drafter`, or None) to serve `slots` requests of up to max_ctx tokens
    with verifies of the planned width (memory_plan.serving_width: budget None = chain), and return that width.

    On a GPU everything the memory plan counts per slot and per device is taken now: `slots` pooled states of
    max_ctx rows with room for n_capture captured layers, as many drafter sessions, and the graph arena; the split
    scratch's size is fixed; the states' checkpoints and the graph steps' logits rows are capped at the planned
    state width (memory_plan.state_width: the verify width, on a GPU at least a prompt's 64-token graph steps);
    then every kernel a request may launch is fetched (prompt chunks of every width class, a plain step, the
    drafter's appends) and the drafter's passes of a step's appends are captured, so that no request builds a
    kernel or, in the first context bucket, captures a drafter pass or a prompt chunk's step. A NumPy model only
    learns its pool sizes (it allocates per request, as the CPU plan counts). layer_ids: a remote drafter's feature
    layers where known (an in-process drafter's are its own; its n_capture layers: a speculative request's prompt
    graphs are captured with them, a plain one's with none)."""
    from . import memory_plan as mp

    block = getattr(drafter, "block_size", mp.DEFAULT_BLOCK_SIZE)
    backend = getattr(getattr(model, "be", None), "name", "numpy")
    width = mp.serving_width(speculative, budget, block, backend)
    if hasattr(model, "state_pool_size"):
        model.state_pool_size = slots
    if drafter is not None and hasattr(drafter, "session_pool_size"):
        drafter.session_pool_size = slots
    if not hasattr(model, "reserve_states"):
        return width
    from .models.qwen35_gpu import graph_arena

    # the states' steps: verifies of up to `width` tokens and a prompt's graph steps (memory_plan.state_width)
    model.max_tree = mp.state_width(speculative, budget, block, backend)
    # what CuPy's pool caches from loading goes back first, so that no state is carved out of a cached block (the
    # rest of that block would stay held)
    model.release_cached_memory()
    gpu_drafter = drafter if hasattr(drafter, "reserve_sessions") else None
    if gpu_drafter is not None:
        gpu_drafter.reserve_sessions(slots, max_ctx)
    model.reserve_states(slots, max_ctx, n_capture)
    kv_k, kv_v = model.kv_cache_types
    arena = mp.graph_arena_bytes(model.cfg, model.max_tree, kv_k, kv_v,
                                 mp.drafter_shape_of(gpu_drafter.cfg) if gpu_drafter is not None else None,
                                 mp.device_sms(parse_device(device)))
    graph_arena(model.be.xp).reserve(arena, exact=True)
    # the wide kernel's split scratch (one buffer per stream) and a slot's sampler workspace are made at their
    # planned sizes when first used: neither grows
    from kernels import quant_gemv
    from kernels import sampling as smp

    quant_gemv.reserve_split_scratch(*mp.split_scratch_need(gpu_matrices(model, gpu_drafter),
                                                            mp.device_sms(parse_device(device))))
    smp.reserve_rows(width)
    # what CuPy's pool cached meanwhile (the weights' upload temporaries, the arena the model reserved when it
    # loaded): back to the device
    model.release_cached_memory()
    # every kernel a request may launch fetched now, not mid-request (an NVRTC build is 0.4-0.5 s on a cold cache):
    # prompt chunks of every width class (the captured layers' ids do not change the kernels; where prompts run as
    # graph steps, the graphs of the layer sets requests capture: none for a plain one, the drafter's for a
    # speculative one), and the drafter's passes of a step's appends (captured) and a prompt's appends
    n_layer = int(model.cfg.n_layer)
    if layer_ids is None and drafter is not None:
        layer_ids = getattr(drafter, "target_layer_ids", None)
    warm = list(layer_ids) if layer_ids and len(layer_ids) == n_capture else list(range(n_capture))
    warm = warm if speculative and 0 < n_capture <= n_layer else []
    model.warm_prefill(capture=warm, prompt_captures=[[]] + ([warm] if warm else []))
    if gpu_drafter is not None and speculative:
        gpu_drafter.capture_passes()
        gpu_drafter.warm_appends()
    return width
