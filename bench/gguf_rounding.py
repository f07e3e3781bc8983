"""What ``quantization=auto`` costs in accuracy on GGUF files, against the same file in float32
(``none``) and against the file it was quantized from: is auto's rounding small beside the
file's own quantization error?

    llama-quantize --allow-requantize SmolLM2-135M-Instruct.Q4_1.gguf /tmp/q/Q2_K.gguf Q2_K
    python bench/gguf_rounding.py --reference smollm2 /tmp/q/Q2_K.gguf /tmp/q/IQ3_XXS.gguf

Per file, over ``tests/model/perplexity_text.txt`` (one prefill, every position's logits):

* ``auto vs none``: mean and max |logit difference|, top-1 agreement, perplexity of each; and
  the part of it that is the weights' rounding alone (float32 arithmetic on auto's weights);
* ``none vs reference``: the same measures between the file in float32 and the reference file
  in float32: the error the file's own quantization adds (the scale auto's rounding is judged by);
* per projection type, ``weights``: the RMS of auto's weight change (what it multiplies by against
  gguf's float32) over the RMS of the file's own change (the file against the reference), over
  the tensors of that type, and the same ratio per block of 32 (its median and largest); 0 for
  types held as stored.

Weight comparisons need the same architecture and shapes in every file (llama-quantize's outputs
of one model). Each file's two models are built from one read of it.
"""
from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TEXT = Path(__file__).resolve().parent.parent / "tests" / "model" / "perplexity_text.txt"
_PROJECTIONS = {"self_attn.q_proj": "self_attn.qkv_proj", "self_attn.k_proj": "self_attn.qkv_proj",
                "self_attn.v_proj": "self_attn.qkv_proj", "self_attn.o_proj": "self_attn.o_proj",
                "mlp.gate_proj": "mlp.gate_up_proj", "mlp.up_proj": "mlp.gate_up_proj",
                "mlp.down_proj": "mlp.down_proj"}


def _logits(model, ids: list[int]):
    """One prefill of ``ids``: logits at every position [T, vocab] (tests/model/test_logits.py's way)."""
    from tests.model.test_logits import _prefill_logits

    return _prefill_logits(model, ids)


def _perplexity(logits, ids: list[int]) -> float:
    import torch

    logp = torch.log_softmax(logits[:-1].double(), dim=-1)
    return math.exp(float(-logp.gather(1, torch.tensor(ids[1:])[:, None]).mean()))


def _compare(ours, ref) -> dict:
    change = (ours - ref).abs()
    return {"mean": float(change.mean()), "max": float(change.max()),
            "top1": float((ours.argmax(-1) == ref.argmax(-1)).double().mean())}


def _projections(model) -> dict[str, "torch.Tensor"]:
    """HF projection name -> the weight the model multiplies by [out, in] float32 (fused ones split)."""
    out = {}
    for i, layer in enumerate(model.layers):
        fused = {}
        for name, where in _PROJECTIONS.items():
            if where not in fused:
                fused[where] = layer.get_submodule(where).dense_weight()
        a = model.arch
        q, kv, inter = a.q_size, a.kv_size, a.intermediate_size
        qkv, gate_up = fused["self_attn.qkv_proj"], fused["mlp.gate_up_proj"]
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": qkv[:q], p + "self_attn.k_proj.weight": qkv[q:q + kv],
                    p + "self_attn.v_proj.weight": qkv[q + kv:], p + "self_attn.o_proj.weight": fused["self_attn.o_proj"],
                    p + "mlp.gate_proj.weight": gate_up[:inter], p + "mlp.up_proj.weight": gate_up[inter:],
                    p + "mlp.down_proj.weight": fused["mlp.down_proj"]})
    return out


class _RoundedWeights(Mapping):
    """A GGUF's float32 tensors with those auto rounds (``_ROUNDED_TYPES``) rounded to 8-bit
    blocks as w8a8 does and dequantized: float32 arithmetic on auto's weights, which tells the
    weights' rounding apart from the int8 rounding of activations (w8a8's for every type)."""

    def __init__(self, weights) -> None:
        self._weights = weights

    def __getitem__(self, name: str):
        from sluice.engine.loaders.quantized import _ROUNDED_TYPES
        from sluice.engine.models import quant

        w = self._weights[name]
        if w.dim() != 2 or self._weights.tensor_type(name) not in _ROUNDED_TYPES:
            return w
        u, d, m = quant.float_to_block(w, 8)
        return (u.float().view(*w.shape[:1], -1, 32) * d[..., None] + m[..., None]).reshape(w.shape)

    def __contains__(self, name: object) -> bool:
        return name in self._weights

    def __iter__(self):
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)


def _build(arch, weights, fmt: str):
    import torch

    from sluice.engine.loaders import build_model

    return build_model(arch, weights, torch.float32, torch.device("cpu"), quantization=fmt)


def main() -> None:
    import torch

    from sluice.engine.loaders import load_model, resolve_path
    from sluice.engine.loaders.gguf_loader import load_gguf
    from sluice.engine.loaders.quantized import projection_types, resolve_quantization

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--reference", default="smollm2", help="the file the others were quantized from")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    ref = load_model(args.reference, dtype="float32", quantization="none")
    ids = ref.tokenizer.encode(TEXT.read_text())
    ref_logits = _logits(ref.model, ids)
    ref_weights = _projections(ref.model)
    print(f"{len(ids)} positions; reference {resolve_path(args.reference).name} in float32: "
          f"perplexity {_perplexity(ref_logits, ids):.3f}")
    rows, weight_rows = [], []
    for path in args.files:
        arch, weights, _reader = load_gguf(path)
        fmt = resolve_quantization("auto", weights, torch.device("cpu"))
        types = {name: weights.tensor_type(name) for name in ref_weights}
        none, auto = _build(arch, weights, "none"), _build(arch, weights, fmt)
        none_logits, auto_logits = _logits(none, ids), _logits(auto, ids)
        rounded_logits = _logits(_build(arch, _RoundedWeights(weights), "none"), ids)
        own, ours = _compare(none_logits, ref_logits), _compare(auto_logits, none_logits)
        rows.append((Path(path).name, ",".join(sorted(projection_types(weights))), fmt, _perplexity(none_logits, ids),
                     _perplexity(auto_logits, ids), ours, own, _compare(rounded_logits, none_logits)))
        file_w, auto_w = _projections(none), _projections(auto)
        sums, blocks = defaultdict(lambda: [0.0, 0.0, 0]), defaultdict(list)
        for name, kind in types.items():
            rounding, own = auto_w[name] - file_w[name], file_w[name] - ref_weights[name]
            s = sums[kind]
            s[0] += float((rounding ** 2).sum())
            s[1] += float((own ** 2).sum())
            s[2] += 1
            per_block = [x.reshape(-1, 32).pow(2).mean(-1).sqrt() for x in (rounding, own)]
            blocks[kind].append(per_block[0][per_block[1] > 0] / per_block[1][per_block[1] > 0])
        for kind, (rounding, own_sq, n) in sorted(sums.items()):
            ratios = torch.cat(blocks[kind])
            weight_rows.append((Path(path).name, kind, n, math.sqrt(rounding / own_sq) if own_sq else float("nan"),
                                float(ratios.median()) if len(ratios) else float("nan"),
                                float(ratios.max()) if len(ratios) else float("nan")))
        del none, auto
    print("\n| file | projection types | auto | perplexity none → auto | auto vs none: mean / max \\|Δlogit\\|, top-1 "
          "| of which the weights' rounding | none vs reference: mean / max \\|Δlogit\\|, top-1 | ratio of mean \\|Δlogit\\| |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    measures = lambda c: f"{c['mean']:.4f} / {c['max']:.3f}, {c['top1']:.3f}"   # noqa: E731
    for name, kinds, fmt, ppl_none, ppl_auto, ours, own, weights_only in rows:
        print(f"| {name} | {kinds} | {fmt} | {ppl_none:.3f} → {ppl_auto:.3f} ({100 * (ppl_auto / ppl_none - 1):+.2f}%) | "
              f"{measures(ours)} | {measures(weights_only)} | {measures(own)} | {ours['mean'] / own['mean'] if own['mean'] else float('nan'):.3f} |")
    print("\n| file | projection type | tensors | RMS of auto's weight change ÷ RMS of the file's own | "
          "the same per block of 32: median, largest |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name, kind, n, ratio, median, largest in weight_rows:
        print(f"| {name} | {kind} | {n} | {ratio:.4f} | {median:.4f}, {largest:.4f} |")


if __name__ == "__main__":
    main()
