"""Write a 1B-class random-weight Llama GGUF (TinyLlama-1.1B's shapes: hidden 2048, 22 layers,
32 query / 4 KV heads, FFN 5632) with SmolLM2's tokenizer (vocabulary 49152), for speed and
memory comparisons at a size where weights, not Python, set the pace.

    python bench/make_1b_gguf.py out/f16.gguf --type F16         # for llama-quantize
    python bench/make_1b_gguf.py out/q4km.gguf --type Q4_K_M     # written directly
    python bench/make_1b_gguf.py out/q41.gguf --type Q4_1 --layers 4

``--type`` is one GGML type for every projection (F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, IQ4_NL, IQ4_XS,
Q6_K), or a mix after llama.cpp's presets: ``Q4_K_M`` / ``Q5_K_M`` keep attn_v and ffn_down in
Q6_K on the first and last eighth of the layers and every third one between, the rest Q4_K /
Q5_K; the output matrix is Q6_K in both and in Q6_K. Blocks are written by the tests' encoder
(tests/helpers/kquant_encode.py: plain min/max rounding) or gguf's own, so a file made here is
not bit-identical to llama-quantize's; its layout and its speed are the same. Weights are
N(0, 0.02) (norms 1): the text it writes is noise, which is fine for timing.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HIDDEN, INTER, HEADS, KV_HEADS = 2048, 5632, 32, 4
MIXES = {"Q4_K_M": ("Q4_K", "Q6_K"), "Q5_K_M": ("Q5_K", "Q6_K")}


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's rule for the layers whose attn_v / ffn_down get more bits in the _M presets."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(name: str, layer: int, layers: int, preset: str) -> str:
    if preset not in MIXES:
        return "Q6_K" if name == "output" and preset.endswith("_K") else preset
    base, high = MIXES[preset]
    if name == "output" or (name in ("attn_v", "ffn_down") and more_bits(layer, layers)):
        return high
    return base


def _copy_tokenizer(writer, source: Path) -> int:
    """SmolLM2's tokenizer fields into ``writer``; returns the vocabulary size."""
    import gguf

    from sluice.engine.loaders.gguf_loader import open_gguf

    reader = open_gguf(source)
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    return len(reader.fields["tokenizer.ggml.tokens"].data)


def main() -> None:
    import gguf

    from tests.helpers.kquant_encode import encode
    from tests.model_files import smollm2_gguf

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--type", default="F16")
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(args.out), "llama")
    writer.add_name(f"random-1b-{args.type}")
    writer.add_block_count(args.layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    vocab = _copy_tokenizer(writer, smollm2_gguf())

    def add(name: str, shape: tuple[int, ...], kind: str | None) -> None:
        w = (rng.standard_normal(shape, dtype=np.float32) * 0.02) if kind else np.ones(shape, np.float32)
        if kind is None:
            writer.add_tensor(name, w)
        elif kind == "F16":
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, encode(w, kind), raw_dtype=gguf.GGMLQuantizationType[kind])
        print(f"{name} {kind or 'F32'} {shape}", flush=True)

    d = HIDDEN // HEADS
    add("token_embd.weight", (vocab, HIDDEN), MIXES[args.type][0] if args.type in MIXES else args.type)
    add("output_norm.weight", (HIDDEN,), None)
    add("output.weight", (vocab, HIDDEN), tensor_type("output", 0, args.layers, args.type))
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * d, HIDDEN), "attn_v": (KV_HEADS * d, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN),
              "ffn_down": (HIDDEN, INTER)}
    for i in range(args.layers):
        add(f"blk.{i}.attn_norm.weight", (HIDDEN,), None)
        add(f"blk.{i}.ffn_norm.weight", (HIDDEN,), None)
        for name, shape in shapes.items():
            add(f"blk.{i}.{name}.weight", shape, tensor_type(name, i, args.layers, args.type))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {args.out} ({args.out.stat().st_size / 2 ** 20:.0f} MiB)")


if __name__ == "__main__":
    main()
