"""Writing trained draft heads in the public layouts that ``spec_decode.heads`` reads back
(FasterDecoding's Medusa, SafeAILab's EAGLE-1)."""
from __future__ import annotations

import json
from pathlib import Path

from sluice.engine.models.config import ModelArchConfig
from sluice.engine.spec_decode.heads import EAGLE_FILES, MEDUSA_FILES, EagleHead, MedusaHeads, _DraftVocab, eagle_config


def _write(folder: str | Path, cfg: dict, module: _DraftVocab, state: dict, filename: str) -> Path:
    """config.json and the tensors (plus ``t2d`` when the module has a draft vocabulary)."""
    from safetensors.torch import save_file
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if module.draft_vocab is not None:
        state["t2d"] = module.draft_mask()
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / filename))
    return folder


def save_medusa(heads: MedusaHeads, folder: str | Path, base_model: str = "") -> Path:
    cfg = {"medusa_num_heads": heads.num_heads, "medusa_num_layers": heads.num_layers,
           "hidden_size": heads.hidden_size, "base_model_name_or_path": base_model}
    return _write(folder, cfg, heads, heads.public_state_dict(), MEDUSA_FILES[0])


def save_eagle(head: EagleHead, folder: str | Path, target: ModelArchConfig, base_model: str = "") -> Path:
    cfg = eagle_config(target, head.arch.intermediate_size) | {"base_model_name_or_path": base_model,
                                                                "bias": head.fc.bias is not None}
    return _write(folder, cfg, head, head.public_state_dict(), EAGLE_FILES[0])
