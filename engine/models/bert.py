"""A BERT encoder (BertModel, BertForSequenceClassification) for embeddings and reranking.

Word + position + token-type embeddings → LayerNorm → N post-norm layers of [fused QKV
projection → bidirectional attention over the unpadded keys → output projection → residual +
LayerNorm; up projection → GELU → down projection → residual + LayerNorm]. A cross-encoder adds
the pooler (dense + tanh over the first token) and a linear classifier.

The batch is padded on the right: ``input_ids [B, S]`` with ``attention_mask [B, S]`` (1 = real
token). Padded positions produce hidden states that callers must ignore (pooling masks them).

Weights arrive under Hugging Face names (``encoder.layer.N.attention.self.query.weight``, with
a ``bert.`` prefix in task-head checkpoints); ``load_hf_weights`` checks every shape, fuses Q/K/V
and names what is missing or wrong.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from sluice.engine.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("BertModel", "BertForSequenceClassification")
_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    pad_token_id: int = 0
    num_labels: int = 0            # 0: no classification head (BertModel)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings", "type_vocab_size"):
            _positive_int(name, getattr(self, name))
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size: {self.hidden_size} is not a multiple of "
                             f"num_attention_heads {self.num_attention_heads}")
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act: {self.hidden_act!r} is not supported (one of {_ACTIVATIONS})")
        if not self.layer_norm_eps > 0:
            raise ValueError(f"layer_norm_eps: must be > 0, got {self.layer_norm_eps!r}")
        if self.num_labels < 0:
            raise ValueError(f"num_labels: must be >= 0, got {self.num_labels}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> BertConfig:
        """Read ``config.json``; raises ValueError naming the field that is missing or unsupported."""
        archs = cfg.get("architectures") or ["BertModel"]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architectures: {arch!r} is not supported (one of {SUPPORTED_ARCHITECTURES})")
        if cfg.get("model_type", "bert") != "bert":
            raise ValueError(f"model_type: {cfg.get('model_type')!r} is not supported (only 'bert')")
        pos_type = cfg.get("position_embedding_type", "absolute")
        if pos_type != "absolute":
            raise ValueError(f"position_embedding_type: {pos_type!r} is not supported (only 'absolute')")
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size", "max_position_embeddings")
        missing = [k for k in required if k not in cfg]
        if missing:
            raise ValueError(f"{missing[0]}: missing from config.json")
        num_labels = 0
        if arch == "BertForSequenceClassification":
            num_labels = len(cfg["id2label"]) if "id2label" in cfg else cfg.get("num_labels", 2)
        return cls(
            **{k: cfg[k] for k in required},
            type_vocab_size=cfg.get("type_vocab_size", 2),
            layer_norm_eps=cfg.get("layer_norm_eps", 1e-12),
            hidden_act=cfg.get("hidden_act", "gelu"),
            pad_token_id=cfg.get("pad_token_id", 0) or 0,
            num_labels=num_labels,
        )


def _activation(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "gelu":
        return F.gelu(x)                       # exact (erf), as BERT's "gelu"
    if name == "relu":
        return F.relu(x)
    return F.gelu(x, approximate="tanh")       # gelu_new / gelu_pytorch_tanh


class BertEmbeddings(torch.nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position = torch.nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type = torch.nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.norm = torch.nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        # input_ids, token_type_ids [B, S]
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)      # [S]
        x = self.word(input_ids) + self.token_type(token_type_ids) + self.position(positions)
        return self.norm(x)                                                         # [B, S, H]


class BertLayer(torch.nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads, self.head_dim, self.act = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_act
        self.qkv = torch.nn.Linear(h, 3 * h)
        self.attn_out = torch.nn.Linear(h, h)
        self.attn_norm = torch.nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.up = torch.nn.Linear(h, cfg.intermediate_size)
        self.down = torch.nn.Linear(cfg.intermediate_size, h)
        self.mlp_norm = torch.nn.LayerNorm(h, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        # x [B, S, H]; key_mask [B, 1, 1, S] bool, True where the key is a real token
        b, s, h = x.shape
        qkv = self.qkv(x).view(b, s, 3, self.num_heads, self.head_dim)             # [B, S, 3, nh, d]
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)                              # each [B, nh, S, d]
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)         # [B, nh, S, d]
        attn = attn.transpose(1, 2).reshape(b, s, h)                                # [B, S, H]
        x = self.attn_norm(x + self.attn_out(attn))
        return self.mlp_norm(x + self.down(_activation(self.act, self.up(x))))     # [B, S, H]


class BertEncoder(torch.nn.Module):
    """BertModel without its pooler, plus pooler + classifier when ``cfg.num_labels > 0``."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.layers = torch.nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))
        if cfg.num_labels:
            self.pooler = torch.nn.Linear(cfg.hidden_size, cfg.hidden_size)
            self.classifier = torch.nn.Linear(cfg.hidden_size, cfg.num_labels)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        # input_ids, attention_mask, token_type_ids [B, S] → last hidden states [B, S, H]
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        key_mask = attention_mask.bool()[:, None, None, :]                          # [B, 1, 1, S]
        x = self.embeddings(input_ids, token_type_ids)
        for layer in self.layers:
            x = layer(x, key_mask)
        return x

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden [B, S, H] → logits [B, num_labels], from the first ([CLS]) token
        if not self.cfg.num_labels:
            raise RuntimeError("classify: this encoder has no classification head (a BertModel)")
        pooled = torch.tanh(self.pooler(hidden[:, 0]))                               # [B, H]
        return self.classifier(pooled)


def _hf_name_plan(cfg: BertConfig) -> dict[str, list[str]]:
    """Our parameter name → the Hugging Face tensor names it is built from (concatenated on dim 0)."""
    plan = {
        "embeddings.word.weight": ["embeddings.word_embeddings.weight"],
        "embeddings.position.weight": ["embeddings.position_embeddings.weight"],
        "embeddings.token_type.weight": ["embeddings.token_type_embeddings.weight"],
        "embeddings.norm.weight": ["embeddings.LayerNorm.weight"],
        "embeddings.norm.bias": ["embeddings.LayerNorm.bias"],
    }
    for i in range(cfg.num_hidden_layers):
        hf, ours = f"encoder.layer.{i}.", f"layers.{i}."
        for p in ("weight", "bias"):
            plan[f"{ours}qkv.{p}"] = [f"{hf}attention.self.{n}.{p}" for n in ("query", "key", "value")]
            plan[f"{ours}attn_out.{p}"] = [f"{hf}attention.output.dense.{p}"]
            plan[f"{ours}attn_norm.{p}"] = [f"{hf}attention.output.LayerNorm.{p}"]
            plan[f"{ours}up.{p}"] = [f"{hf}intermediate.dense.{p}"]
            plan[f"{ours}down.{p}"] = [f"{hf}output.dense.{p}"]
            plan[f"{ours}mlp_norm.{p}"] = [f"{hf}output.LayerNorm.{p}"]
    if cfg.num_labels:
        for p in ("weight", "bias"):
            plan[f"pooler.{p}"] = [f"pooler.dense.{p}"]
            plan[f"classifier.{p}"] = [f"classifier.{p}"]
    return plan


def _canonical_names(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip the ``bert.`` prefix of task-head checkpoints; old TF ports say gamma/beta for LayerNorm."""
    out = {}
    for name, tensor in weights.items():
        if name.startswith("bert."):
            name = name[len("bert."):]
        if name.endswith("LayerNorm.gamma"):
            name = name[: -len("gamma")] + "weight"
        elif name.endswith("LayerNorm.beta"):
            name = name[: -len("beta")] + "bias"
        out[name] = tensor
    return out


def load_hf_weights(model: BertEncoder, weights: Mapping[str, torch.Tensor], source: str) -> None:
    """Copy Hugging Face tensors into ``model``; ModelLoadError naming ``source`` and the tensor when
    one is missing or of the wrong shape. Extra tensors (position_ids, an unused pooler, MLM heads)
    are ignored."""
    weights = _canonical_names(weights)
    params = dict(model.named_parameters())
    plan = _hf_name_plan(model.cfg)
    missing = sorted(n for names in plan.values() for n in names if n not in weights)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"{source}: missing tensors: {shown}")
    with torch.no_grad():
        for ours, hf_names in plan.items():
            target = params[ours]
            per_part = target.shape[0] // len(hf_names)
            for j, hf in enumerate(hf_names):
                tensor = weights[hf]
                want = (per_part, *target.shape[1:])
                if tuple(tensor.shape) != want:
                    raise ModelLoadError(f"{source}: tensor {hf} has shape {tuple(tensor.shape)}, "
                                         f"expected {want} from config.json")
                target[j * per_part:(j + 1) * per_part].copy_(tensor)
