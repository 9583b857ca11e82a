"""Exact parameter counts of GPT- and Llama-style transformers, and presets of published models.

    from labkit.costs import models
    spec = models.preset("llama2-7b")
    models.num_params(spec)          # 6_738_415_616, the published "6.74B"

Two families are described by one `ModelSpec`:

- GPT (GPT-2, GPT-3): learned position embeddings, LayerNorm with a bias, biases on every linear
  layer, a plain MLP h -> 4h -> h, input and output embeddings tied (one matrix).
- Llama: rotary positions (no position parameters), RMSNorm (a weight, no bias), no biases, a
  gated MLP (SwiGLU: gate and up h -> f, down f -> h, so three matrices), grouped-query attention
  (fewer key-value heads than query heads), untied embeddings.

One layer holds attention (q: h*h, k and v: h*kv_dim each, o: h*h, where kv_dim = n_kv_heads *
head_dim), the MLP (2*h*f plain, 3*h*f gated), two norms, and biases where the family has them.
Pure arithmetic: no torch. Counts are integers, exact, and tested against published sizes and
against labkit.model.GPT.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


def kv_heads(n_heads: int, n_kv_heads: int | None) -> int:
    """Key/value heads: n_kv_heads under grouped-query attention; None means one per query head
    (multi-head attention). labkit.model's GPTConfig and ModelSpec both count them here."""
    return n_heads if n_kv_heads is None else n_kv_heads


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder-only transformer, enough to count its parameters exactly."""
    name: str
    vocab_size: int
    hidden: int                    # h, the model width
    n_layers: int                  # L
    n_heads: int                   # a, query heads
    n_kv_heads: int | None = None  # None: = n_heads (multi-head); fewer: grouped-query attention
    ffn_hidden: int | None = None  # f; None: 4*h
    gated_mlp: bool = False        # SwiGLU (3 matrices) instead of GELU MLP (2 matrices)
    tied_embeddings: bool = False  # output projection shares the input embedding matrix
    bias: bool = False             # biases on linear layers (GPT) or not (Llama)
    norm: str = "rmsnorm"          # "rmsnorm" (weight only) or "layernorm" (weight and bias)
    max_positions: int = 0         # learned position embeddings (GPT); 0 for rotary (Llama)
    seq_len: int = 2048            # the context it was trained with (a default for calculators)
    published: str = ""            # the size its authors quote, for the reader
    dropout: bool = False          # trained with dropout (GPT-2/3: 0.1; Llama: none); activations
    n_experts: int = 0             # 0: a dense MLP; E > 0: every MLP is a mixture of E experts,
                                   # each an MLP of this spec's shape (h -> f -> h), plus a router
    top_k: int = 0                 # experts each token visits (k of E), when n_experts > 0

    def __post_init__(self):
        for field in ("vocab_size", "hidden", "n_layers", "n_heads"):
            if int(getattr(self, field)) < 1:
                raise ValueError(f"{self.name}: {field} must be a positive integer, "
                                 f"got {getattr(self, field)!r}")
        if self.hidden % self.n_heads:
            raise ValueError(f"{self.name}: hidden={self.hidden} must be divisible by "
                             f"n_heads={self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"{self.name}: n_heads={self.n_heads} must be divisible by "
                             f"n_kv_heads={self.kv_heads}")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"{self.name}: top_k={self.top_k} must be between 1 and "
                             f"n_experts={self.n_experts} (a token visits k of the E experts)")
        if self.norm not in ("rmsnorm", "layernorm"):
            raise ValueError(f"{self.name}: norm must be 'rmsnorm' or 'layernorm', "
                             f"got {self.norm!r}")

    @property
    def kv_heads(self) -> int:
        return kv_heads(self.n_heads, self.n_kv_heads)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def ffn(self) -> int:
        return 4 * self.hidden if self.ffn_hidden is None else self.ffn_hidden

    def with_(self, **changes) -> "ModelSpec":
        """A copy with some fields changed (e.g. a custom model from a preset)."""
        return replace(self, **changes)


# ----------------------------------------------------------------------------- counting
def attention_params(spec: ModelSpec) -> int:
    h, kv = spec.hidden, spec.kv_dim
    weights = h * h + 2 * h * kv + h * h          # q, k, v, o
    biases = (h + 2 * kv + h) if spec.bias else 0
    return weights + biases


def mlp_params(spec: ModelSpec) -> int:
    """One layer's MLP: a dense MLP, or n_experts of them and the router (h x E, no bias)."""
    one = _one_mlp_params(spec)
    return one if not spec.n_experts else spec.n_experts * one + spec.hidden * spec.n_experts


def _one_mlp_params(spec: ModelSpec) -> int:
    h, f = spec.hidden, spec.ffn
    if spec.gated_mlp:
        return 3 * h * f + ((2 * f + h) if spec.bias else 0)   # gate, up: h->f; down: f->h
    return 2 * h * f + ((f + h) if spec.bias else 0)            # fc: h->f; proj: f->h


def norm_params(spec: ModelSpec) -> int:
    """One normalisation layer: a weight, plus a bias for a LayerNorm in a model with biases."""
    return spec.hidden * (2 if spec.norm == "layernorm" and spec.bias else 1)


def layer_params(spec: ModelSpec) -> int:
    """One transformer block: attention, MLP and its two norms."""
    return attention_params(spec) + mlp_params(spec) + 2 * norm_params(spec)


def embedding_params(spec: ModelSpec) -> int:
    """Token embedding, position embedding (if learned) and the output projection (if untied)."""
    tok = spec.vocab_size * spec.hidden
    pos = spec.max_positions * spec.hidden
    out = 0 if spec.tied_embeddings else spec.vocab_size * spec.hidden
    return tok + pos + out


def num_params(spec: ModelSpec) -> int:
    """Every parameter, counted once (a tied embedding is one matrix)."""
    return embedding_params(spec) + spec.n_layers * layer_params(spec) + norm_params(spec)


def matmul_params(spec: ModelSpec) -> int:
    """Parameters that multiply activations: N less the lookup tables (position embeddings, and
    the token embedding unless it is tied to the output projection). The N of '6N FLOPs per
    token': a lookup costs no multiply-adds. Norm weights are kept (elementwise, negligible)."""
    lookups = spec.max_positions * spec.hidden
    if not spec.tied_embeddings:
        lookups += spec.vocab_size * spec.hidden
    return num_params(spec) - lookups


def expert_params(spec: ModelSpec) -> int:
    """Parameters in experts, all layers (0 for a dense model): what expert parallelism shards."""
    return spec.n_layers * spec.n_experts * _one_mlp_params(spec)


def active_params(spec: ModelSpec) -> int:
    """Parameters one token's forward touches: all but the E - k experts it skips (= N when
    dense). Mixtral-8x7B: 12.9B of 46.7B."""
    skipped = spec.n_layers * (spec.n_experts - spec.top_k) * _one_mlp_params(spec)
    return num_params(spec) - skipped


def active_matmul_params(spec: ModelSpec) -> int:
    """matmul_params counting only the k experts a token visits: the N of 6N for a mixture."""
    return matmul_params(spec) - (num_params(spec) - active_params(spec))


def breakdown(spec: ModelSpec) -> dict:
    """Where the parameters are: {"embeddings", "attention", "mlp", "norms", "total"}."""
    L = spec.n_layers
    parts = {"embeddings": embedding_params(spec), "attention": L * attention_params(spec),
             "mlp": L * mlp_params(spec), "norms": (2 * L + 1) * norm_params(spec)}
    parts["total"] = sum(parts.values())
    return parts


def largest_module_params(spec: ModelSpec) -> int:
    """Parameters of the largest single module (one nn.Linear or nn.Embedding with its bias).

    DeepSpeed's ZeRO-3 estimate adds a buffer for this: the biggest tensor it must gather whole.
    In large-vocabulary models it is the embedding matrix."""
    h, f, kv = spec.hidden, spec.ffn, spec.kv_dim
    b = 1 if spec.bias else 0
    return max(spec.vocab_size * h, h * f + b * f, f * h + b * h, h * h + b * h, h * kv + b * kv)


# ----------------------------------------------------------------------------- presets
PRESETS = {
    "gpt2-124m": ModelSpec("GPT-2 (124M)", vocab_size=50257, hidden=768, n_layers=12, n_heads=12,
                           tied_embeddings=True, bias=True, norm="layernorm", max_positions=1024,
                           seq_len=1024, published="124M", dropout=True),
    "gpt3-175b": ModelSpec("GPT-3 (175B)", vocab_size=50257, hidden=12288, n_layers=96,
                           n_heads=96, tied_embeddings=True, bias=True, norm="layernorm",
                           max_positions=2048, seq_len=2048, published="175B", dropout=True),
    "llama2-7b": ModelSpec("Llama-2-7B", vocab_size=32000, hidden=4096, n_layers=32, n_heads=32,
                           ffn_hidden=11008, gated_mlp=True, seq_len=4096, published="6.74B"),
    "llama2-13b": ModelSpec("Llama-2-13B", vocab_size=32000, hidden=5120, n_layers=40,
                            n_heads=40, ffn_hidden=13824, gated_mlp=True, seq_len=4096,
                            published="13.0B"),
    "llama2-70b": ModelSpec("Llama-2-70B", vocab_size=32000, hidden=8192, n_layers=80,
                            n_heads=64, n_kv_heads=8, ffn_hidden=28672, gated_mlp=True,
                            seq_len=4096, published="69.0B (\"70B\")"),
    "llama3-8b": ModelSpec("Llama-3-8B", vocab_size=128256, hidden=4096, n_layers=32, n_heads=32,
                           n_kv_heads=8, ffn_hidden=14336, gated_mlp=True, seq_len=8192,
                           published="8.03B"),
    "llama3-405b": ModelSpec("Llama-3.1-405B", vocab_size=128256, hidden=16384, n_layers=126,
                             n_heads=128, n_kv_heads=8, ffn_hidden=53248, gated_mlp=True,
                             seq_len=8192, published="405B"),
    # Mixtral 8x7B (Jiang et al. 2024, "Mixtral of Experts", table 1: dim 4096, 32 layers, head
    # dim 128, 32 heads, 8 kv heads, hidden 14336, vocab 32000, 8 experts, top-2; 47B parameters,
    # 13B active). The counts here give 46,702,792,704 total and 12,879,925,248 active (the
    # router counted as active).
    "mixtral-8x7b": ModelSpec("Mixtral-8x7B", vocab_size=32000, hidden=4096, n_layers=32,
                              n_heads=32, n_kv_heads=8, ffn_hidden=14336, gated_mlp=True,
                              seq_len=32768, published="46.7B (12.9B active)", n_experts=8,
                              top_k=2),
}


def preset(name: str) -> ModelSpec:
    """A published model by key (see PRESETS), e.g. preset("llama3-8b")."""
    key = name.lower().replace("_", "-")
    if key not in PRESETS:
        raise KeyError(f"no preset named {name!r}; choose one of {', '.join(PRESETS)} "
                       f"or build a ModelSpec(...) for a custom model")
    return PRESETS[key]


def from_gpt_config(cfg, name: str = "tiny GPT (labkit.model)") -> ModelSpec:
    """The ModelSpec of a labkit.model.GPTConfig: the book's tiny GPT, counted the same way."""
    return ModelSpec(name, vocab_size=cfg.vocab_size, hidden=cfg.n_embd, n_layers=cfg.n_layer,
                     n_heads=cfg.n_head, n_kv_heads=cfg.n_kv_head,
                     ffn_hidden=cfg.ffn_mult * cfg.n_embd, gated_mlp=False,
                     tied_embeddings=cfg.tie_weights, bias=cfg.bias,
                     norm="layernorm", max_positions=cfg.block_size, seq_len=cfg.block_size,
                     dropout=cfg.dropout > 0)
