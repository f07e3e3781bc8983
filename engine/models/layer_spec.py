"""What one decoder layer is made of: the description both layer stacks build from.

The Python layers (``models.llama``) and the C++ stack (``models.layer_stack``, over
``kernels/cpu_stack.cpp``) read a ``LayerSpec`` and nothing else about the architecture, so an
architecture that differs from Llama only in these fields (a bias, per-head q/k norms) needs a
row in ``config.ARCHITECTURES``, not a new model class or a second C++ copy of its forward.
"""
from __future__ import annotations

from dataclasses import dataclass

from sluice.engine.models.config import ARCHITECTURES, ModelArchConfig

NORMS = ("rms", "gemma_rms")  # rms: RMSNorm (statistics in float32, HF's order of operations);
                              # gemma_rms: the same times (1 + weight), in float32, rounded last (Gemma)
MLPS = ("swiglu", "moe", "geglu")  # swiglu: down(silu(gate(x)) * up(x)), gate and up fused into one
                          # product; moe: routed SwiGLU experts (``MoESpec``, ``models.moe``);
                          # geglu: down(gelu_tanh(gate(x)) * up(x)) (Gemma)


@dataclass(frozen=True)
class MoESpec:
    """A mixture-of-experts MLP: each token runs its ``top_k`` of ``num_experts`` SwiGLU experts
    (``intermediate_size`` each), weighted by their softmax router probabilities, renormalised
    over the k when ``norm_topk_prob``; plus, when ``shared_intermediate_size`` > 0, a shared
    SwiGLU expert on every token scaled by sigmoid(shared gate . x) (Qwen2-MoE)."""
    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    shared_intermediate_size: int = 0

    @classmethod
    def from_arch(cls, arch: ModelArchConfig) -> MoESpec | None:
        if not arch.num_experts:
            return None
        return cls(num_experts=arch.num_experts, top_k=arch.num_experts_per_tok,
                   intermediate_size=arch.moe_intermediate_size, norm_topk_prob=arch.norm_topk_prob,
                   shared_intermediate_size=arch.shared_expert_intermediate_size)


@dataclass(frozen=True)
class AttentionSpec:
    num_heads: int
    num_kv_heads: int               # GQA: num_heads is a multiple of it
    head_dim: int
    qkv_bias: bool                  # the fused q/k/v projection adds a bias
    qk_norm: bool                   # RMSNorm over head_dim on each query and key head, before RoPE
    # This layer's window: a query at position p attends to positions p - sliding_window + 1 .. p
    # (transformers' convention); None: the whole causal prefix. Per layer (ModelArchConfig.
    # layer_window), so that sliding and global layers may alternate; both stacks read it here.
    sliding_window: int | None
    # With qk_norm: one RMSNorm over the whole q (q_size) and k (kv_size) projections instead of
    # one per head (OLMoE); both stacks run it.
    qk_norm_full: bool = False
    # Queries are scaled by scale_base ** -0.5 (Gemma's query_pre_attn_scalar); None: head_dim's.
    scale_base: float | None = None
    # Scores pass cap * tanh(score / cap) before the mask and the softmax (Gemma 2); None: not.
    softcap: float | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def scale(self) -> float:
        return (self.head_dim if self.scale_base is None else self.scale_base) ** -0.5


@dataclass(frozen=True)
class OutputShard:
    """Tensor parallelism's exact split (``engine.parallel.tensor``): the layer's ``o_proj`` and
    ``down_proj`` hold ``rows`` of the hidden output rows and read the whole attention output
    (``attention_in`` wide) and MLP activation (``mlp_in``), gathered from the ranks by the C++
    stack, so each output sums over its whole input as one rank would. With experts, ``mlp_in``
    is each routed expert's activation and ``shared_in`` the shared expert's (0: none)."""
    rows: int
    attention_in: int
    mlp_in: int
    shared_in: int = 0


@dataclass(frozen=True)
class LayerSpec:
    hidden_size: int
    intermediate_size: int
    norm_eps: float                 # every RMSNorm of the layer (and the q/k norms) uses it
    attention: AttentionSpec
    norm: str = "rms"
    mlp: str = "swiglu"
    moe: MoESpec | None = None      # the experts, exactly when mlp == "moe"
    # Norms on the attention's and the MLP's outputs too, before each residual add, and one
    # before the MLP (Gemma's four norms a layer): models.gemma.GemmaDecoderLayer.
    sandwich_norms: bool = False
    shard: OutputShard | None = None

    @property
    def o_shape(self) -> tuple[int, int]:
        """(out, in) of o_proj."""
        s = self.shard
        return (self.hidden_size, self.attention.q_size) if s is None else (s.rows, s.attention_in)

    @property
    def down_shape(self) -> tuple[int, int]:
        """(out, in) of down_proj."""
        s = self.shard
        return (self.hidden_size, self.intermediate_size) if s is None else (s.rows, s.mlp_in)

    def __post_init__(self) -> None:
        if self.norm not in NORMS:
            raise ValueError(f"norm: must be one of {NORMS}, got {self.norm!r}")
        if self.mlp not in MLPS:
            raise ValueError(f"mlp: must be one of {MLPS}, got {self.mlp!r}")
        if (self.mlp == "moe") != (self.moe is not None):
            raise ValueError(f"moe: a {self.mlp} MLP {'needs' if self.mlp == 'moe' else 'takes no'} MoESpec")

    def cpp_stack_lacks(self) -> str | None:
        """What of this layer ``kernels/cpu_stack.cpp``'s DecoderStack cannot run (the C++ stack
        is then never chosen: ``layer_stack.select_layer_stack``), or None."""
        # It runs Gemma's (1 + weight) norms (their weights hold the multiplier, in float32), GeGLU,
        # the sandwich norms, any query scale, attention soft-capping, Gemma 3's local RoPE tables,
        # routed experts (StackMoE, models.moe's arithmetic) and q/k norms per head or over the
        # whole projections (StackSpec.qk_norm_full, OLMoE): every layer a LayerSpec describes so
        # far. A field it cannot run names itself here, and its models keep the Python layers.
        return None

    @classmethod
    def from_arch(cls, arch: ModelArchConfig, layer: int = 0) -> LayerSpec:
        """Layer ``layer``'s description (layers differ only in their window so far)."""
        traits = ARCHITECTURES[arch.architecture]
        gemma = arch.gemma
        attention = AttentionSpec(
            num_heads=arch.num_attention_heads, num_kv_heads=arch.num_key_value_heads, head_dim=arch.head_dim,
            qkv_bias=arch.attention_bias, qk_norm=traits.qk_norm, sliding_window=arch.layer_window(layer),
            qk_norm_full=traits.qk_norm_full, scale_base=None if gemma is None else float(gemma.query_pre_attn_scalar),
            softcap=None if gemma is None else gemma.attn_softcap)
        moe = MoESpec.from_arch(arch)
        mlp = "geglu" if gemma is not None else "swiglu" if moe is None else "moe"
        shard = None if arch.output_shard is None else OutputShard(*arch.output_shard)
        return cls(hidden_size=arch.hidden_size, intermediate_size=arch.intermediate_size,
                   norm_eps=arch.rms_norm_eps, attention=attention, mlp=mlp, moe=moe,
                   norm="rms" if gemma is None else "gemma_rms", sandwich_norms=gemma is not None, shard=shard)
