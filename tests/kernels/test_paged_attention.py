"""Paged decode and prefill/extend kernels equal their torch references and plain causal attention.

Shapes cover head_dim 64 and 80 (non-power-of-2), block sizes 1, 16 and 32, GQA ratios 1, 3
and 8, ragged lengths, a sequence ending exactly on a block boundary, a prefix-hit chunk and
split-KV decode. Each case is checked twice: against the kernel's ``*_ref`` and against torch
SDPA over K/V rebuilt token by token from the block table. Draft-tree rows are checked against
attention over the sequence each node's path spells.
"""
from __future__ import annotations

import pytest
import torch

from sluice.kernels.paged_decode import choose_num_splits, paged_decode, paged_decode_ref
from sluice.kernels.paged_prefill import block_n_for, paged_prefill, paged_prefill_ref
from tests.kernels.conftest import BF16_DOT
from tests.kernels.paged_cases import dense_attention, dense_kv, make_case, tree_attention, tree_rows

SHAPES = [(64, 1, 16), (80, 3, 16), (64, 8, 1), (80, 1, 32), (80, 8, 32), (64, 3, 1)]  # head_dim, group, block


def _close(actual, expected, dtype=torch.float32):
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("head_dim,group,block_size", SHAPES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode(device, head_dim, group, block_size, num_splits):
    # Ragged lengths; 2 * block_size ends exactly on a block boundary; 1 is a lone first token.
    seq_lens = [7, 2 * block_size, 1, 45]
    case = make_case(seq_lens, [1] * 4, block_size, 2, group, head_dim, device=device)
    out = paged_decode(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                       case.scale, num_splits=num_splits)
    _close(out, paged_decode_ref(case.query, case.key_cache, case.value_cache, case.block_tables,
                                 case.seq_lens, case.scale))
    _close(out, dense_attention(case))


def test_paged_decode_default_splits_and_max_len(device):
    case = make_case([33, 64], [1, 1], 16, 1, 8, 64, device=device)
    out = paged_decode(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                       case.scale, max_seq_len=64)
    _close(out, dense_attention(case))


def test_choose_num_splits_fills_the_machine_only_for_long_contexts():
    assert choose_num_splits(num_seqs=256, num_kv_heads=8, max_seq_len=32768) == 1
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=32768) == 32
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=300) == 1


@pytest.mark.parametrize("head_dim,group,block_size", SHAPES)
def test_paged_prefill_varlen_batch(device, head_dim, group, block_size):
    # seq 0: plain prefill; seq 1: prefix-hit chunk (2 cached blocks, then 5 new tokens);
    # seq 2: a decode row in a mixed step; seq 3: chunk ending on a block boundary.
    seq_lens = [9, 2 * block_size + 5, 20, 3 * block_size]
    query_lens = [9, 5, 1, block_size]
    case = make_case(seq_lens, query_lens, block_size, 2, group, head_dim, device=device)
    out = paged_prefill(case.query, case.key_cache, case.value_cache, case.block_tables,
                        case.query_start_loc, case.seq_lens, case.scale)
    _close(out, paged_prefill_ref(case.query, case.key_cache, case.value_cache, case.block_tables,
                                  case.query_start_loc, case.seq_lens, case.scale))
    _close(out, dense_attention(case))


def test_paged_prefill_chunk_longer_than_one_tile(device):
    # 70 query rows span two 64-row tiles; the second tile starts mid-sequence behind a prefix.
    case = make_case([90, 3], [70, 3], 16, 1, 3, 80, device=device)
    out = paged_prefill(case.query, case.key_cache, case.value_cache, case.block_tables,
                        case.query_start_loc, case.seq_lens, case.scale, max_query_len=70)
    _close(out, dense_attention(case))


def test_paged_prefill_head_dim_256_in_fp32_uses_narrower_key_tiles(device):
    # fp32 rows of 1 KB get 32-token key tiles (shared memory on A100); 75 tokens span 3 of them.
    assert block_n_for(torch.float32, 256) == 32 and block_n_for(torch.bfloat16, 256) == 64
    case = make_case([75, 40], [30, 40], 16, 1, 2, 256, device=device)
    out = paged_prefill(case.query, case.key_cache, case.value_cache, case.block_tables,
                        case.query_start_loc, case.seq_lens, case.scale)
    _close(out, dense_attention(case))


@pytest.mark.parametrize("dtype", [torch.float16, BF16_DOT])
@pytest.mark.parametrize("head_dim,group,block_size", [(128, 4, 16), (80, 3, 1)])
def test_paged_kernels_half_precision(device, dtype, head_dim, group, block_size):
    case = make_case([300, 17], [1, 1], block_size, 2, group, head_dim, dtype=dtype, device=device)
    out = paged_decode(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                       case.scale, num_splits=4)
    _close(out, dense_attention(case), dtype)
    case = make_case([300, 17], [200, 17], block_size, 2, group, head_dim, dtype=dtype, device=device)
    out = paged_prefill(case.query, case.key_cache, case.value_cache, case.block_tables,
                        case.query_start_loc, case.seq_lens, case.scale)
    _close(out, dense_attention(case), dtype)


def _decode_args(case):
    return {"query": case.query, "key_cache": case.key_cache, "value_cache": case.value_cache,
            "block_tables": case.block_tables, "seq_lens": case.seq_lens, "scale": case.scale}


@pytest.mark.parametrize("change,message", [
    (lambda a: {**a, "query": a["query"][:, :3]}, "query: num_heads 3 is not a multiple of num_kv_heads 2"),
    (lambda a: {**a, "query": a["query"][..., :32]}, "query: head_dim 32 differs"),
    (lambda a: {**a, "block_tables": a["block_tables"].long()}, "block_tables: dtype must be one of \\(int32\\)"),
    (lambda a: {**a, "seq_lens": a["seq_lens"][:1]}, "block_tables: 2 rows for 1 sequences"),
    (lambda a: {**a, "value_cache": a["value_cache"].double()}, "value_cache: dtype must be one of"),
    (lambda a: {**a, "num_splits": 0}, "num_splits: must be >= 1"),
])
def test_paged_decode_rejects_bad_arguments(change, message):
    args = change(_decode_args(make_case([5, 9], [1, 1], 16, 2, 2, 64)))
    with pytest.raises(ValueError, match=message):
        paged_decode(**args)


def test_paged_prefill_rejects_bad_query_start_loc():
    case = make_case([5, 9], [5, 9], 16, 2, 2, 64)
    with pytest.raises(ValueError, match="query_start_loc: expected shape \\(3,\\)"):
        paged_prefill(case.query, case.key_cache, case.value_cache, case.block_tables,
                      case.query_start_loc[:2], case.seq_lens, case.scale)


# Draft trees: parents per node (spec_decode.tree); the second keeps a deep branch behind a
# shallow sibling, so node order and depth differ.
TREES = ([-1, -1, 0, 0, 2, 1], [-1, 0, 1, -1, 3, 2, 0])


@pytest.mark.parametrize("head_dim,group,block_size", SHAPES)
def test_paged_prefill_draft_tree_rows_see_their_path_only(device, head_dim, group, block_size):
    """A tree node's row is attention over the known tokens and its own path (tree_attention,
    which needs no mask); the other rows of the step, a plain chunk, a decode row and the
    tree's own last known token, stay causal. The reference takes the same mask."""
    # seq 0: last known token + tree 0 after 30 known; seq 1: a chunk; seq 2: two known rows +
    # tree 1; seq 3: a decode row.
    trees = {0: TREES[0], 2: TREES[1]}
    seq_lens = [30 + 6, 2 * block_size + 5, 9 + 7, 20]
    query_lens = [1 + 6, 5, 2 + 7, 1]
    case = make_case(seq_lens, query_lens, block_size, 2, group, head_dim, device=device)
    node_start, visible = tree_rows(case, trees)
    args = (case.query, case.key_cache, case.value_cache, case.block_tables, case.query_start_loc, case.seq_lens,
            case.scale)
    out = paged_prefill(*args, node_start=node_start, visible=visible)
    _close(out, tree_attention(case, trees))
    _close(out, paged_prefill_ref(*args, node_start=node_start, visible=visible))
    # Read as one causal sequence, only the last known token and node 0 (whose path is the
    # first index) come out the same; every later node sees what it must not.
    plain = paged_prefill(*args)
    _close(plain[:2], out[:2])
    assert all(not torch.allclose(plain[r], out[r], atol=1e-3) for r in range(2, 7))


@pytest.mark.parametrize("change,message", [
    (lambda ns, vis: (ns, None), "node_start and visible go together"),
    (lambda ns, vis: (ns.long(), vis), "node_start: dtype must be one of \\(int32\\)"),
    (lambda ns, vis: (ns, vis.bool()), "visible: dtype must be one of \\(int8\\)"),
    (lambda ns, vis: (ns, vis[:4]), "visible: expected \\[7, num_nodes >= 1\\]"),
    (lambda ns, vis: (ns[:3], vis), "node_start: expected shape \\(7,\\)"),
])
def test_paged_prefill_rejects_bad_tree_arguments(change, message):
    case = make_case([36], [7], 16, 2, 2, 64)
    node_start, visible = change(*tree_rows(case, {0: TREES[0]}))
    with pytest.raises(ValueError, match=message):
        paged_prefill(case.query, case.key_cache, case.value_cache, case.block_tables, case.query_start_loc,
                      case.seq_lens, case.scale, node_start=node_start, visible=visible)


# ---- sliding windows: a query at p sees p - window + 1 .. p --------------------------------------
def _poison_before_windows(case, window: int, rows_first_pos: list[int]):
    """A copy of the case whose blocks wholly before each sequence's earliest window hold NaN: the
    KV manager may have given them to another sequence, so a kernel must never read them (a NaN
    read, even masked, would reach the output through p @ v)."""
    kc, vc = case.key_cache.clone(), case.value_cache.clone()
    bs = kc.shape[1]
    for seq, first_pos in enumerate(rows_first_pos):
        for b in range(max(0, first_pos - window + 1) // bs):
            blk = int(case.block_tables[seq, b])
            kc[blk], vc[blk] = float("nan"), float("nan")
    return kc, vc


@pytest.mark.parametrize("head_dim,group,block_size", [(64, 1, 16), (80, 3, 1), (64, 8, 4)])
@pytest.mark.parametrize("window", [5, 16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_with_a_window_reads_only_the_window(device, head_dim, group, block_size, window, num_splits):
    seq_lens = [7, 2 * block_size, 1, 45]
    case = make_case(seq_lens, [1] * 4, block_size, 2, group, head_dim, device=device)
    kc, vc = _poison_before_windows(case, window, [n - 1 for n in seq_lens])
    out = paged_decode(case.query, kc, vc, case.block_tables, case.seq_lens, case.scale, num_splits=num_splits,
                       window=window)
    _close(out, paged_decode_ref(case.query, case.key_cache, case.value_cache, case.block_tables,
                                 case.seq_lens, case.scale, window=window))
    _close(out, dense_attention(case, window))
    assert not torch.allclose(out, dense_attention(case), atol=1e-3)     # the window changes row 3


@pytest.mark.parametrize("head_dim,group,block_size", [(64, 1, 16), (80, 3, 1), (64, 8, 4)])
@pytest.mark.parametrize("window", [5, 16])
def test_paged_prefill_with_a_window_reads_only_the_window(device, head_dim, group, block_size, window):
    # A plain prefill longer than the window, a chunk behind a cached prefix, a decode row, and a
    # 70-row chunk spanning two query tiles (the second tile's window starts mid-sequence).
    seq_lens = [23, 2 * block_size + 5, 20, 90]
    query_lens = [23, 5, 1, 70]
    case = make_case(seq_lens, query_lens, block_size, 2, group, head_dim, device=device)
    kc, vc = _poison_before_windows(case, window, [n - q for n, q in zip(seq_lens, query_lens)])
    out = paged_prefill(case.query, kc, vc, case.block_tables, case.query_start_loc, case.seq_lens, case.scale,
                        window=window)
    _close(out, paged_prefill_ref(case.query, case.key_cache, case.value_cache, case.block_tables,
                                  case.query_start_loc, case.seq_lens, case.scale, window=window))
    _close(out, dense_attention(case, window))


@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_prefill_draft_tree_rows_with_a_window_see_the_window_of_their_position(device, block_size):
    """A node at index n + i sits at position n - 1 + depth: its window over the known tokens is
    that position's, and its ancestors (at most the tree's depth back) are all within it."""
    from sluice.engine.spec_decode.tree import path

    window, parents = 9, TREES[1]
    seq_lens, query_lens = [30 + len(parents), 12], [2 + len(parents), 3]
    case = make_case(seq_lens, query_lens, block_size, 2, 3, 64, device=device)
    node_start, visible = tree_rows(case, {0: parents})
    args = (case.query, case.key_cache, case.value_cache, case.block_tables, case.query_start_loc, case.seq_lens,
            case.scale)
    out = paged_prefill(*args, node_start=node_start, visible=visible, window=window)
    _close(out, paged_prefill_ref(*args, node_start=node_start, visible=visible, window=window))
    want = dense_attention(case, window)
    n, k_all = 30, dense_kv(case.key_cache, case.block_tables[0], seq_lens[0]).float()
    v_all = dense_kv(case.value_cache, case.block_tables[0], seq_lens[0]).float()
    for i in range(len(parents)):
        nodes = path(parents, i)
        pos = n - 1 + len(nodes)
        keys = [c for c in range(n) if c > pos - window] + [n + j for j in nodes]
        q = case.query[2 + i].float()[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k_all[keys].transpose(0, 1), v_all[keys].transpose(0, 1), scale=case.scale, enable_gqa=True)
        want[2 + i] = o[:, 0]
    _close(out, want)


def test_paged_kernels_refuse_a_bad_window():
    case = make_case([5, 9], [1, 1], 16, 2, 2, 64)
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="window: must be None or a positive integer"):
            paged_decode(**_decode_args(case), window=bad)
        with pytest.raises(ValueError, match="window: must be None or a positive integer"):
            paged_prefill(case.query, case.key_cache, case.value_cache, case.block_tables, case.query_start_loc,
                          case.seq_lens, case.scale, window=bad)


@pytest.mark.parametrize("seq_lens,query_lens", [
    ([23, 13, 20, 90], [23, 5, 1, 70]),    # prefill and long chunk (_extend), one short query (_short), a decode row
    ([30, 25, 40], [3, 4, 1]),             # short queries together (_short_batch) and a decode row
    ([7, 8, 1, 45], [1, 1, 1, 1]),         # pure decode
])
@pytest.mark.parametrize("block_size", [4, 16])
def test_the_torch_backend_with_a_window_reads_only_the_window(seq_lens, query_lens, block_size):
    """The CPU reference backend (engine.attention.torch_backend) on every path it takes, and the
    C++ stack's paged_decode (one row per query token), with the blocks before the windows NaN."""
    from sluice.engine.attention.base import row_prefixes
    from sluice.engine.attention.torch_backend import TorchAttentionBackend
    from tests.kernels.test_backends import _meta

    window = 6
    case = make_case(seq_lens, query_lens, block_size, 2, 3, 64)
    kc, vc = _poison_before_windows(case, window, [n - q for n, q in zip(seq_lens, query_lens)])
    meta = _meta(seq_lens, query_lens, block_size, case.block_tables.tolist(), "cpu")
    new_k, new_v = (c.view(-1, *c.shape[2:])[meta.slot_mapping] for c in (case.key_cache, case.value_cache))
    out = TorchAttentionBackend().forward(case.query, new_k, new_v, (kc, vc), meta, case.scale, window)
    _close(out, dense_attention(case, window))
    from sluice.kernels import cpu_ext

    if not cpu_ext.available():
        pytest.skip(f"the C++ kernels: {cpu_ext.unavailable_reason()}")
    tables, lens = row_prefixes(meta)
    got = cpu_ext.module().paged_decode(case.query, kc, vc, tables, lens, case.scale, window=window)
    _close(got, dense_attention(case, window))


@pytest.mark.parametrize("speculation", ["none", "medusa tree"])
def test_the_engine_on_the_triton_kernels_with_a_window_gives_the_torch_backends_tokens(tmp_path, device,
                                                                                      speculation):
    """A tiny Mistral (window 6, blocks of 4) through the whole engine: attention_backend="triton"
    (the interpreter on CPU) gives the torch backend's greedy tokens past the window, with chunked
    prefill, decodes, blocks released, and (medusa) draft-tree rows through paged_prefill."""
    import dataclasses

    from sluice.engine.llm import LLM
    from sluice.engine.loaders import LoadedModel
    from sluice.engine.sampling_params import SamplingParams
    from tests.kernels.test_engine_triton_e2e import _tiny_llama, _tokenizer
    from tests.model.test_spec_decode_distribution import random_heads

    tok = _tokenizer(tmp_path)
    base = _tiny_llama(torch.float32, device)
    arch = dataclasses.replace(base.arch, architecture="mistral", sliding_window=6)
    from sluice.engine.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM(arch, max_seq_len=128, device=device)
    model.load_state_dict(base.state_dict())
    loaded = LoadedModel(model=model, arch=arch, tokenizer=tok, name="tiny-mistral", path=tmp_path,
                         dtype=torch.float32, device=device)
    prompts = [[5, 17, 3, 9, 22, 41, 8, 30, 31, 2], [60, 2, 33, 33, 12, 7, 1, 19, 44, 50, 3, 3, 6, 71, 15], [4]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    spec = {} if speculation == "none" else dict(
        speculative_mode="medusa", additional_models="random medusa heads", heads=random_heads(loaded, "medusa"),
        spec_tree_width=3, spec_min_draft_prob=0.0, spec_draft_length=3, spec_max_batch_size=8)
    tokens = {}
    for attention in ("torch", "triton"):
        llm = LLM("tiny-mistral", loaded=loaded, device=str(device), attention_backend=attention, block_size=4,
                  max_num_batched_tokens=16, kv_cache_memory_bytes=1 << 20, **spec)
        assert llm.engine.kv.sliding_window == 6
        tokens[attention] = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
        assert llm.engine.kv.stats().in_use == 0
        if spec:
            assert llm.engine.spec.proposer.tree_width == 3 and llm.engine.spec.stats.num_drafts > 5
    assert tokens["triton"] == tokens["torch"]
