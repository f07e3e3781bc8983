"""Writing the tiny test models as GGUF files the way llama.cpp's converter lays them out: the
keys every dense decoder carries, then the tensors (float32, or 2-D and 3-D weights in Q8_0 blocks,
a 3-D stack of experts quantized one matrix at a time) and the file. Each test adds the keys and
tensor names of its own architecture between the two."""
from __future__ import annotations

import numpy as np


def start(path, arch: str, config, rope_base: float | None = None, head_dim: int | None = None):
    """A ``gguf.GGUFWriter`` for ``arch`` holding ``config``'s (a transformers config) shape keys;
    ``head_dim``: written as the key and value length when given."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    if head_dim is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if rope_base is not None:
        writer.add_rope_freq_base(rope_base)
    writer.add_vocab_size(config.vocab_size)
    return writer


def tiny_llama_keys(writer, *, layers: int, context: int, hidden: int, inter: int, heads: int, kv_heads: int,
                    tokens: list[str]) -> None:
    """The shape keys of a tiny Llama (RMSNorm eps 1e-5, RoPE base 10000) and a byte-pair vocabulary
    of ``tokens`` whose first three are control tokens (1 BOS, 2 EOS), with two merges."""
    writer.add_block_count(layers)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(["a b", "c d"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def q8_0(w: np.ndarray) -> np.ndarray:
    """A 2-D matrix, or each matrix of a 3-D stack, as Q8_0 blocks (the bytes llama.cpp writes)."""
    import gguf

    if w.ndim == 2:
        return gguf.quantize(np.ascontiguousarray(w), gguf.GGMLQuantizationType.Q8_0)
    return np.stack([gguf.quantize(np.ascontiguousarray(m), gguf.GGMLQuantizationType.Q8_0)
                     for m in w.reshape(-1, *w.shape[-2:])]).reshape(*w.shape[:-1], -1)


def finish(writer, tensors: dict[str, np.ndarray], quantize=lambda name, w: False) -> None:
    """Add ``tensors`` (GGUF names) — in Q8_0 where ``quantize(name, w)`` says so, else as given —
    and write the file."""
    import gguf

    for name, w in tensors.items():
        if quantize(name, w):
            writer.add_tensor(name, q8_0(w), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
