"""What a CPU engine process does not import: triton (its library is ~64 MiB resident, and the
C++ kernels are all a w4a8 engine runs) and torch._dynamo (with sympy: ~2 s and ~100 MiB,
pulled in by initialising parameters on the meta device)."""
from __future__ import annotations

import subprocess
import sys


def test_a_cpu_engine_and_its_embedding_model_import_neither_triton_nor_dynamo(tiny_smollm2):
    code = ("import sys\n"
            "from sluice.engine.llm import LLM\n"
            "from sluice.engine.loaders.bert_loader import load_embedding_model\n"
            "from sluice.engine.sampling_params import SamplingParams\n"
            f"llm = LLM({str(tiny_smollm2)!r}, quantization='w4a8', kv_cache_memory_bytes=4 << 20)\n"
            "out = llm.generate(['hi there'], SamplingParams(max_tokens=3, ignore_eos=True))\n"
            "assert len(out[0].outputs[0].token_ids) == 3 and llm.engine.loaded.model._decoder\n"
            "assert load_embedding_model('all-minilm-l6-v2').encoder is not None\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'triton' or m.startswith('torch._dynamo'))[:3])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"
