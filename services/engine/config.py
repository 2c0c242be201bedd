"""Hyper-parameters of a target model, in llama.cpp's GGUF vocabulary, whatever file they came from."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    arch: str                      # "qwen3" | "qwen35"
    n_layer: int                   # trunk layers (block_count - nextn_predict_layers)
    n_embd: int
    n_ff: int
    n_vocab: int
    n_head: int                    # query heads of the attention layers
    n_head_kv: int
    head_dim: int                  # attention.key_length (== value_length)
    rms_eps: float = 1e-6
    rope_theta: float = 1e6
    n_rot: int = 0                 # rotated dims per head (partial rotary); 0 means head_dim
    context_length: int = 32768
    tied_embeddings: bool = False
    # qwen35 only: which layers are Gated DeltaNet (True) vs gated full attention (False)
    recurrent_layers: list[bool] = field(default_factory=list)
    full_attention_interval: int = 4
    ssm_conv_kernel: int = 4       # conv width
    ssm_head_k_dim: int = 0        # ssm.state_size  (d_k)
    ssm_n_k_heads: int = 0         # ssm.group_count (H_k)
    ssm_n_v_heads: int = 0         # ssm.time_step_rank (H_v)
    ssm_inner_size: int = 0        # H_v * d_v
    name: str = ""

    def __post_init__(self) -> None:
        if self.n_rot == 0:
            self.n_rot = self.head_dim
        if not self.recurrent_layers:
            self.recurrent_layers = [False] * self.n_layer

    @property
    def ssm_head_v_dim(self) -> int:
        return self.ssm_inner_size // self.ssm_n_v_heads if self.ssm_n_v_heads else 0

    @property
    def ssm_key_dim(self) -> int:
        return self.ssm_head_k_dim * self.ssm_n_k_heads

    @property
    def ssm_conv_dim(self) -> int:
        return 2 * self.ssm_key_dim + self.ssm_inner_size

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, r in enumerate(self.recurrent_layers) if not r]

    @property
    def recurrent_layer_ids(self) -> list[int]:
        return [i for i, r in enumerate(self.recurrent_layers) if r]


def _get(meta: dict, key: str, default=None, required: bool = True, path: str = "<model>"):
    if key in meta:
        return meta[key]
    if required and default is None:
        from .errors import ModelFormatError

        raise ModelFormatError(path, f"metadata key '{key}'", "it missing")
    return default


def config_from_gguf(meta: dict, n_vocab: int | None = None, path: str = "<model>") -> ModelConfig:
    """Read a ModelConfig from GGUF metadata (keys as llama.cpp writes them)."""
    arch = _get(meta, "general.architecture", path=path)
    a = arch

    def g(key, default=None, required=True):
        return _get(meta, f"{a}.{key}", default, required, path)

    n_block = int(g("block_count"))
    nextn = int(g("nextn_predict_layers", 0, False))
    n_layer = n_block - nextn
    head_dim = int(g("attention.key_length", 0, False) or 0)
    n_head = int(g("attention.head_count"))
    n_embd = int(g("embedding_length"))
    if not head_dim:
        head_dim = n_embd // n_head
    n_head_kv = g("attention.head_count_kv", n_head, False)
    if isinstance(n_head_kv, list):
        n_head_kv = max(n_head_kv)
    vocab = g("vocab_size", 0, False) or n_vocab or len(meta.get("tokenizer.ggml.tokens", []))
    cfg = ModelConfig(
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_ff=int(g("feed_forward_length")),
        n_vocab=int(vocab),
        n_head=n_head,
        n_head_kv=int(n_head_kv),
        head_dim=head_dim,
        rms_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6, False)),
        rope_theta=float(g("rope.freq_base", 10000.0, False)),
        n_rot=int(g("rope.dimension_count", 0, False) or 0),
        context_length=int(g("context_length", 32768, False)),
        name=str(meta.get("general.name", "")),
    )
    if arch in ("qwen35", "qwen3next"):
        interval = int(g("full_attention_interval", 4, False))
        explicit = g("attention.recurrent_layers", None, False)
        if explicit is not None:
            rec = [bool(x) for x in explicit][:n_layer]
        else:
            rec = [(i + 1) % interval != 0 for i in range(n_layer)]
        cfg.recurrent_layers = rec
        cfg.full_attention_interval = interval
        cfg.ssm_conv_kernel = int(g("ssm.conv_kernel"))
        cfg.ssm_head_k_dim = int(g("ssm.state_size"))
        cfg.ssm_n_k_heads = int(g("ssm.group_count"))
        cfg.ssm_n_v_heads = int(g("ssm.time_step_rank"))
        cfg.ssm_inner_size = int(g("ssm.inner_size"))
    return cfg


def gguf_metadata(cfg: ModelConfig) -> dict:
    """The architecture metadata llama.cpp expects for `cfg` (keys without tokenizer/general.* extras)."""
    a = cfg.arch
    meta = {
        "general.architecture": a,
        f"{a}.block_count": cfg.n_layer,
        f"{a}.context_length": cfg.context_length,
        f"{a}.embedding_length": cfg.n_embd,
        f"{a}.feed_forward_length": cfg.n_ff,
        f"{a}.attention.head_count": cfg.n_head,
        f"{a}.attention.head_count_kv": cfg.n_head_kv,
        f"{a}.attention.key_length": cfg.head_dim,
        f"{a}.attention.value_length": cfg.head_dim,
        f"{a}.attention.layer_norm_rms_epsilon": float(cfg.rms_eps),
        f"{a}.rope.freq_base": float(cfg.rope_theta),
        f"{a}.rope.dimension_count": cfg.n_rot,
        f"{a}.vocab_size": cfg.n_vocab,
    }
    if a == "qwen35":
        meta.update({
            f"{a}.full_attention_interval": cfg.full_attention_interval,
            f"{a}.ssm.conv_kernel": cfg.ssm_conv_kernel,
            f"{a}.ssm.state_size": cfg.ssm_head_k_dim,
            f"{a}.ssm.group_count": cfg.ssm_n_k_heads,
            f"{a}.ssm.time_step_rank": cfg.ssm_n_v_heads,
            f"{a}.ssm.inner_size": cfg.ssm_inner_size,
        })
        expected = [(i + 1) % cfg.full_attention_interval != 0 for i in range(cfg.n_layer)]
        if list(cfg.recurrent_layers) != expected:
            meta[f"{a}.attention.recurrent_layers"] = [bool(x) for x in cfg.recurrent_layers]
    return meta
