"""Registry of target architectures: one module per architecture, each with its model class and HF mapping."""

from __future__ import annotations

from types import ModuleType

from ..errors import UnsupportedModelError
from . import qwen3, qwen35

ARCHITECTURES: dict[str, tuple[ModuleType, type]] = {
    qwen3.ARCH: (qwen3, qwen3.Qwen3Model),
    qwen35.ARCH: (qwen35, qwen35.Qwen35Model),
}

HF_MODEL_TYPES: dict[str, str] = {t: m.ARCH for m, _ in ARCHITECTURES.values() for t in m.HF_MODEL_TYPES}


def arch_module(arch: str) -> ModuleType:
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"unknown architecture '{arch}'; supported: {', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[arch][0]


def model_class(arch: str) -> type:
    arch_module(arch)
    return ARCHITECTURES[arch][1]


def arch_from_hf_config(hf_config: dict, source: str = "<config.json>") -> str:
    text = hf_config.get("text_config") or hf_config
    mt = text.get("model_type") or hf_config.get("model_type")
    if mt in HF_MODEL_TYPES:
        return HF_MODEL_TYPES[mt]
    archs = hf_config.get("architectures") or []
    for a in archs:
        if a.startswith("Qwen3_5"):
            return qwen35.ARCH
        if a.startswith("Qwen3For"):
            return qwen3.ARCH
    raise UnsupportedModelError(
        f"{source}: unknown model_type '{mt}' (architectures {archs}); supported: {sorted(HF_MODEL_TYPES)}")
