"""Self-distilled draft heads: ``sluice train-heads MODEL --kind medusa|eagle --out FOLDER``.

No public heads exist for small models like SmolLM2-135M, so they are trained from the served
model itself, on CPU:

1. **Corpus.** The engine answers a bounded set of chat prompts (``training_prompts``: task
   templates crossed with subjects, and advice / how-to templates crossed with activities,
   written for this purpose and disjoint from the prompts of ``bench/spec_decode.py``),
   greedily, as it would serve them: in the model's served format (``--corpus-quantization``,
   default ``auto``), 64 at a time. Decoding is the one sequential
   stage, and w4a8 answers 2.3x faster than float32 on SmolLM2, so the corpus is 3x what float32
   answered in the same time (the heads are limited by their data, not by their size). Each
   conversation keeps where its answer starts: the heads only ever draft inside answers, so only
   answer positions are trained and scored (the chat template's system prompt, the same in every
   conversation, is predicted almost perfectly and would make the held-out figures look far better
   than drafting is).
2. **Features.** The float32 target runs once over each conversation (prompt + answer) and keeps
   its last hidden state ``h_t`` at every position; the labels are its own greedy choices
   ``y_t = argmax LM(h_t)`` (the token after ``t``), which are what a greedy request's drafts must
   match to be accepted.
3. **Training** with the target frozen (its LM head is shared, never trained):
   - Medusa head ``k`` on ``h_t`` learns ``y_{t+1+k}`` (cross-entropy, weight 0.8^k);
   - EAGLE's layer on the pairs (``embed(x_{i+1})``, ``h_i + noise``) learns ``h_{i+1}``
     (smooth L1) and ``y_{i+1}`` through the LM head (cross-entropy, weight 0.1), teacher-forced
     over whole conversations; and, with the same losses, as a second draft: fed its own
     prediction of ``h_{i+1}`` it learns ``h_{i+2}`` and ``y_{i+2}``, as it is used at serving.
   Both draft from a draft vocabulary (``--draft-vocab``, the tokens the target chose most), so
   their cross-entropies run over it alone: six times less LM head for SmolLM2.
4. The heads are written in the public layouts ``spec_decode.heads`` reads.

Every stage prints its time; the defaults take SmolLM2-135M about 38 minutes on 2 cores
(AVX512-VNNI; peak RSS 6.2 GB, most of it the features of 362k tokens).
"""
from __future__ import annotations

import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sluice.engine.training.args import build_parser

TASKS = (
    "Write a short story about {}.", "Explain {} to a ten-year-old.", "Give me five facts about {}.",
    "Write a poem about {}.", "What are the pros and cons of {}?", "Describe {} in detail.",
    "Write a friendly email to a colleague about {}.", "How would you teach a beginner about {}?",
    "Write a diary entry about {}.", "What questions would a curious child ask about {}? Answer them.",
    "Give me a step-by-step plan for a weekend project involving {}.", "Summarise what people get wrong about {}.",
    "Tell me a bedtime story involving {}.", "What is the most interesting thing about {}?",
    "Write a short dialogue between two friends talking about {}.", "Write a news report about {}.",
    "Write a speech for a school assembly about {}.", "What would the world be like without {}?",
    "Create a quiz with five questions about {}, with the answers.", "Write the opening of a blog post about {}.",
    "Answer as a teacher: why should students learn about {}?", "Write a limerick about {} and explain its joke.",
    "Give me three surprising ideas for a school project about {}.", "Write a review of a book about {}.",
)
SUBJECTS = (
    "the ocean", "volcanoes", "a city at night", "learning a new language", "bicycles", "the moon",
    "coffee", "gardening", "a rainy day", "robots", "the history of bread", "friendship", "mountains",
    "electric cars", "honeybees", "chess", "a busy market", "winter", "trains", "music", "recycling",
    "the human heart", "deserts", "a first day at school", "computers", "rivers", "birds",
    "space travel", "kites", "a library", "solar power", "dogs", "the weather", "a lost key",
    "photography", "football", "clouds", "a small village", "time management", "dinosaurs",
    "the internet", "painting", "a camping trip", "sleep", "tea", "earthquakes", "kindness",
    "a birthday party", "glaciers", "a night train", "saving money", "octopuses", "an old bookshop",
    "wind turbines", "baking a cake", "public speaking", "the stars", "a thunderstorm", "cats",
    "ancient Rome", "a job interview", "swimming", "the harbour", "a family dinner", "smartphones",
    "the alphabet", "a bus journey", "vaccines", "a marathon", "islands", "origami", "the post office",
    "fireflies", "moving to a new city", "knitting", "a hospital night shift", "bridges", "the desert wind",
    "a school play", "mushrooms", "a broken umbrella", "climbing", "the first airplane", "a fishing boat",
    "board games", "spring flowers", "a museum visit", "writing letters", "a power cut", "penguins",
    "street food", "a quiet morning", "the periodic table", "volunteering", "a snowstorm", "maps",
    "the printing press", "a hot air balloon", "honey", "the rainforest", "a city park", "teamwork",
    "submarines", "the solar system", "a road trip", "pottery", "elephants", "a summer festival",
    "the stock market", "lighthouses", "a village bakery", "the Great Wall of China", "owls", "a violin",
    "a science fair", "rainbows", "the Arctic", "a farmers' market", "handwriting", "a shipwreck",
    "video games", "a mountain hut", "wolves", "the first computer", "a crossword puzzle", "tides",
    "a lemonade stand", "castles", "a treehouse", "the nervous system", "a marching band", "comets",
    "an old clock", "sea turtles", "a city bus driver", "the Olympic Games", "candles", "a vegetable patch",
    "the Amazon river", "a circus", "microscopes", "a long winter night", "sharks", "a pen pal",
    "the water cycle", "a small boat", "ants", "a new neighbour", "the Sahara", "a jigsaw puzzle",
    "the compass", "a snowman", "whales", "a kitchen garden", "glassblowing", "a fire station",
    "hedgehogs", "a windmill", "the underground railway", "a paper boat",
)


# A second family: requests about doing something (advice, instructions, how things work), the
# other common shape of chat requests. A head trained on the first family alone drafted answers
# to requests of other shapes much worse than its held-out figure (first draft 0.48 on
# bench/spec_decode.py's open-ended prompts, 0.60 held out).
HOW_TASKS = (
    "What are your best tips for {}?", "List seven practical tips for {}.", "How do I get started with {}?",
    "What mistakes do beginners make when {}?", "Write step-by-step instructions for {}.",
    "What equipment or tools do I need for {}?", "How can I get better at {} in a month?",
    "Explain why people enjoy {}.", "What should I know before {}?", "Make a checklist for {}.",
    "Write a short guide to {} for a busy parent.", "How do professionals approach {}?",
    "What are the health or safety concerns of {}?", "Describe a typical day of someone who loves {}.",
    "Give me a beginner's weekly plan for {}.", "How has {} changed over the last fifty years?",
)
ACTIVITIES = (
    "baking bread", "running a first 5k", "growing tomatoes", "learning the guitar", "keeping a journal",
    "training a puppy", "painting with watercolours", "saving for a holiday", "writing a novel",
    "studying for exams", "planning a wedding", "building a birdhouse", "riding a horse", "making pizza at home",
    "taking better photos", "learning to code", "organising a closet", "brewing coffee", "hiking in the mountains",
    "speaking in public", "fixing a flat tyre", "decorating a small flat", "caring for houseplants",
    "meditating", "playing chess", "sewing a button", "doing yoga", "cleaning a kitchen", "writing a cover letter",
    "cycling to work", "starting a podcast", "learning to draw", "camping with children", "making soup",
    "reading more books", "running a meeting", "negotiating a salary", "ice skating", "bird watching",
    "making new friends", "moving house", "composting", "learning French", "repairing a bicycle chain",
    "writing poetry", "teaching a child to read", "swimming laps", "making candles", "managing stress",
    "cooking for a large family", "growing herbs on a balcony", "learning to juggle", "shopping on a budget",
    "travelling alone", "baking cookies", "planting a tree", "playing the piano", "knitting a scarf",
    "running a small shop", "caring for an elderly parent", "learning to dance", "writing a speech",
    "keeping chickens", "sleeping better", "drinking more water", "preparing for a job interview",
    "painting a room", "brewing tea properly", "sailing a small boat", "making a budget spreadsheet",
)
MAX_PROMPTS = len(TASKS) * len(SUBJECTS) + len(HOW_TASKS) * len(ACTIVITIES)


def training_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct user prompts (at most ``MAX_PROMPTS``) from both families, shuffled by ``seed``."""
    every = [t.format(s) for s in SUBJECTS for t in TASKS] + [t.format(a) for a in ACTIVITIES for t in HOW_TASKS]
    random.Random(seed).shuffle(every)
    return every[:n]


def _log(msg: str) -> None:
    print(f"[train-heads {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- 1. corpus -----------------------------------------------------------------------------
def generate_corpus(llm, prompts: list[str], max_tokens: int) -> tuple[list[list[int]], list[int]]:
    """Token ids of each conversation (rendered chat prompt + the engine's greedy answer), and
    where each answer starts (the prompt's length)."""
    from sluice.engine.sampling_params import SamplingParams

    texts = [llm.engine.render_chat([{"role": "user", "content": p}]) for p in prompts]
    results = llm._run(texts, [SamplingParams(temperature=0.0, max_tokens=max_tokens)] * len(texts),
                       add_special_tokens=False)
    return ([r.prompt_token_ids + r.outputs[0].token_ids for r in results],
            [len(r.prompt_token_ids) for r in results])


def read_corpus(path: Path) -> tuple[list[list[int]], list[int]]:
    """A corpus ``--corpus`` wrote: ``{"conversations": [{"ids": [...], "answer_start": n}]}``."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("conversations"), list):
        raise SystemExit(f"--corpus {path}: not a corpus this version writes (an object with "
                         "'conversations', each with 'ids' and 'answer_start'); delete it to regenerate")
    convs = data["conversations"]
    return [c["ids"] for c in convs], [int(c["answer_start"]) for c in convs]


def write_corpus(path: Path, sequences: list[list[int]], starts: list[int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"conversations": [{"ids": s, "answer_start": a}
                                                  for s, a in zip(sequences, starts)]}))


# ---- 2. features ---------------------------------------------------------------------------
def hidden_states(loaded, sequences: list[list[int]], device, dtype, batch_tokens: int = 2048) -> list[torch.Tensor]:
    """The target's last hidden state at every position of each sequence ([T, H] float32 each),
    computed by the engine's own runner in prefill batches of about ``batch_tokens`` tokens."""
    from sluice.engine.attention.selector import get_attention_backend
    from sluice.engine.model_runner import ModelRunner
    from sluice.engine.spec_decode.draft_model import _Seq, _View

    arch, block = loaded.arch, 16
    longest = max(map(len, sequences))
    num_blocks = (max(batch_tokens, longest) + block - 1) // block + len(sequences)
    runner = ModelRunner(loaded.model, num_layers=arch.num_hidden_layers, num_kv_heads=arch.num_key_value_heads,
                         head_dim=arch.head_dim, num_blocks=min(num_blocks, 4096 + longest // block),
                         block_size=block, vocab_size=arch.vocab_size, device=device, dtype=dtype,
                         attn=get_attention_backend("auto", device))
    out: list[torch.Tensor] = []
    i = 0
    while i < len(sequences):
        batch, used, tokens = [], 0, 0
        while i < len(sequences) and (not batch or tokens + len(sequences[i]) <= batch_tokens):
            seq = sequences[i]
            n = (len(seq) + block - 1) // block
            batch.append(_Seq(_View(list(seq), []), len(seq), 0, tuple(range(used, used + n)), sample=False))
            used, tokens, i = used + n, tokens + len(seq), i + 1
        hidden = runner.forward(runner.prepare(batch)).float()
        start = 0
        for s in batch:
            out.append(hidden[start:start + s.num_new_tokens].clone())
            start += s.num_new_tokens
    return out


def greedy_labels(features: list[torch.Tensor], lm_weight: torch.Tensor, chunk: int = 1024) -> list[torch.Tensor]:
    """y_t = argmax LM(h_t) per position: the target's own next token."""
    labels = []
    with torch.no_grad():   # not inference_mode: the labels enter autograd graphs as targets
        for f in features:
            labels.append(torch.cat([F.linear(f[i:i + chunk], lm_weight).argmax(-1)
                                     for i in range(0, f.shape[0], chunk)]))
    return labels


def draft_vocabulary(labels: list[torch.Tensor], vocab_size: int, size: int) -> torch.Tensor:
    """bool [vocab]: the ``size`` tokens the target chose most often (ties: lower ids)."""
    counts = torch.bincount(torch.cat(labels), minlength=vocab_size).double()
    counts -= torch.arange(vocab_size) * 1e-9          # a stable order among equal counts
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[counts.topk(size).indices] = True
    return mask


# ---- 3. training ---------------------------------------------------------------------------
def _cosine(step: int, total: int, warm: int) -> float:
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))


def _medusa_targets(labels, num_heads: int, starts) -> torch.Tensor:
    """[N, heads]: head k at t learns y_{t+1+k}; -100 where that runs past the conversation's end
    and before its answer: the heads draft from h_t for t >= answer start - 1 (the first from the
    prompt's last position, whose y is the answer's first token)."""
    ys = []
    for lab, start in zip(labels, starts):
        rows = []
        for k in range(num_heads):
            y = torch.full_like(lab, -100)
            y[:lab.shape[0] - 1 - k] = lab[1 + k:]
            y[:max(0, start - 1)] = -100
            rows.append(y)
        ys.append(torch.stack(rows, dim=1))
    return torch.cat(ys)


def _medusa_accuracy(heads, x, y, lm_weight, chunk: int = 1024) -> torch.Tensor:
    correct, count = torch.zeros(y.shape[1]), torch.zeros(y.shape[1])
    with torch.no_grad():
        for i in range(0, x.shape[0], chunk):
            pred = F.linear(heads.features(x[i:i + chunk]), lm_weight).argmax(-1)
            t = y[i:i + chunk]
            correct += ((pred == t) & (t >= 0)).sum(0).float()
            count += (t >= 0).sum(0).float()
    return correct / count.clamp(min=1)


def train_medusa(features, labels, starts, lm_weight, num_heads: int, num_layers: int, epochs: int,
                 batch: int = 256, lr: float = 1e-3, seed: int = 0, held_out=None):
    """``starts``: where each conversation's answer begins (only answer positions are trained).
    ``held_out``: (features, labels, starts) of conversations kept out of training; the epoch
    whose heads predict them best is the one returned."""
    from sluice.engine.spec_decode.heads import MedusaHeads

    torch.manual_seed(seed)
    hidden = lm_weight.shape[1]
    heads = MedusaHeads(hidden, num_heads, num_layers)
    y = _medusa_targets(labels, num_heads, starts)                     # [N, heads]
    keep = (y >= 0).any(dim=1)                                         # rows some head learns from
    x, y = torch.cat(features)[keep], y[keep]                          # [N, H], [N, heads]
    val = None if not held_out or not held_out[0] else (torch.cat(held_out[0]),
                                                          _medusa_targets(held_out[1], num_heads, held_out[2]))
    best = (-1.0, None)
    opt = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.0)
    steps = epochs * math.ceil(x.shape[0] / batch)
    weights = torch.tensor([0.8 ** k for k in range(num_heads)])
    g = torch.Generator().manual_seed(seed)
    step = 0
    for epoch in range(epochs):
        perm = torch.randperm(x.shape[0], generator=g)
        total, correct, count = 0.0, torch.zeros(num_heads), torch.zeros(num_heads)
        for i in range(0, x.shape[0], batch):
            idx = perm[i:i + batch]
            for group in opt.param_groups:
                group["lr"] = lr * _cosine(step, steps, max(1, steps // 20))
            logits = F.linear(heads.features(x[idx]), lm_weight)      # [B, heads, V]
            target = y[idx]
            loss = sum(weights[k] * F.cross_entropy(logits[:, k], target[:, k], ignore_index=-100)
                       for k in range(num_heads))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            with torch.no_grad():
                ok = target >= 0
                correct += ((logits.argmax(-1) == target) & ok).sum(0).float()
                count += ok.sum(0).float()
                total += float(loss) * idx.numel()
        acc = ", ".join(f"{a:.2f}" for a in (correct / count.clamp(min=1)).tolist())
        msg = f"medusa epoch {epoch + 1}/{epochs}: loss {total / x.shape[0]:.3f}, top-1 per head {acc}"
        if val is not None:
            v = _medusa_accuracy(heads, *val, lm_weight)
            msg += ", held out " + ", ".join(f"{a:.2f}" for a in v.tolist())
            score = float((v * weights).sum())
            if score > best[0]:
                best = (score, {k: t.clone() for k, t in heads.state_dict().items()})
        _log(msg)
    if best[1] is not None:
        heads.load_state_dict(best[1])
    return heads.eval()


def _answer_targets(lab: torch.Tensor, start: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The labels a first and a second draft learn, -100 before the answer. The pair at i
    (teacher-forced) drafts y_{i+1}; at serving the first draft comes from the pair at
    answer start - 1 on. The second draft at p (fed the head's own h_p) drafts y_{p+1} and follows
    a first draft, so it starts a position later; its row p - 1 has the same bound."""
    first, second = lab[1:t + 1].clone(), lab[2:t + 1].clone()
    first[:max(0, start - 1)] = -100
    second[:max(0, start - 1)] = -100
    return first, second


def _eagle_accuracy(head, features, labels, sequences, starts, loaded, lm_weight) -> tuple[float, float]:
    """Top-1 on the answers of whole conversations of the first draft (y_{i+1} from the pair at
    i, teacher-forced) and of the second (y_{i+2} from the head fed its own first prediction,
    ``_second_drafts``)."""
    ok = [0, 0]
    n = [0, 0]
    with torch.no_grad():
        for seq, f, lab, start in zip(sequences, features, labels, starts):
            t = len(seq) - 1
            embeds = loaded.model.embed(torch.tensor(seq[1:])).float()
            pred = head(embeds, f[:t], list(range(t)))
            first, second = _answer_targets(lab, start, t)
            steps = [(pred, first)]
            if t > 1:
                steps.append((_second_drafts(head, embeds, f[:t], pred), second))
            for j, (p, target) in enumerate(steps):
                ok[j] += int((F.linear(p, lm_weight).argmax(-1) == target).sum())
                n[j] += int((target >= 0).sum())
    return ok[0] / max(1, n[0]), ok[1] / max(1, n[1])


def _second_drafts(head, embeds: torch.Tensor, inputs: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
    """For every position p >= 1 of a conversation, what a second draft would be at serving:
    the pair (embed(x_{p+1}), the head's own prediction of h_p), attending to the first pass's
    entries before p and to itself. [t, H] pass-1 rows in -> [t - 1, H] predictions of h_{p+1}."""
    t = pred.shape[0]
    k, v = head.keys_values(embeds, inputs, list(range(t)))
    return head.forward_next_drafts(embeds[1:t], pred[:t - 1], list(range(1, t)), (k, v, list(range(t))))


def train_eagle(features, labels, sequences, starts, loaded, lm_weight, epochs: int, intermediate_size: int | None,
                tokens_per_step: int = 512, lr: float = 1e-3, noise: float = 0.1, seed: int = 0, held_out=None,
                second_draft: bool = True):
    """Trained on answer positions only (``starts``: where each answer begins); the head still
    runs over the whole conversation, whose prompt its attention reads.
    ``held_out``: (features, labels, sequences, starts) kept out of training; the best epoch on them
    (by first- plus second-draft top-1) is returned. ``second_draft``: also train every position
    as a second draft, the head fed its own first prediction (``_second_drafts``), with the same
    losses; serving feeds the head its own outputs from the second draft on, and a head trained
    only teacher-forced drifts there (its second draft was accepted 7% of the time on SmolLM2)."""
    from sluice.engine.models.config import ModelArchConfig
    from sluice.engine.spec_decode.heads import EagleHead, eagle_config

    torch.manual_seed(seed)
    arch = ModelArchConfig.from_hf_config(eagle_config(loaded.arch, intermediate_size))
    head = EagleHead(arch)
    with torch.no_grad():   # start the fc as "take the hidden state": the head begins near the identity
        head.fc.weight.zero_()
        head.fc.weight[:, arch.hidden_size:] = torch.eye(arch.hidden_size)
        head.fc.bias.zero_()
        head.o_proj.weight.mul_(0.1)
        head.down_proj.weight.mul_(0.1)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    # Conversations with an answer to draft in (one whose answer is empty has nothing to learn).
    order = [i for i, (q, a) in enumerate(zip(sequences, starts)) if max(0, a - 1) < len(q) - 1]
    if not order:
        raise SystemExit("train-heads: no conversation has an answer to train EAGLE on")
    total_tokens = sum(max(0, len(s) - max(1, a)) for s, a in zip(sequences, starts))
    steps = epochs * math.ceil(total_tokens / tokens_per_step)
    rng = random.Random(seed)
    step, best = 0, (-1.0, None)
    for epoch in range(epochs):
        rng.shuffle(order)
        sums = {"reg": 0.0, "cls": 0.0, "acc": 0.0, "n": 0, "valid": 0}
        pending = 0
        opt.zero_grad(set_to_none=True)
        for n, i in enumerate(order):
            seq, f, lab, start = sequences[i], features[i], labels[i], starts[i]
            t = len(seq) - 1                          # pairs (embed(x_{i+1}), h_i) for i < T - 1
            rows = max(0, start - 1)                  # the first row a draft comes from
            with torch.no_grad():
                embeds = loaded.model.embed(torch.tensor(seq[1:])).float()
                scale = f.std() * noise
            inp = f[:t] + torch.randn_like(f[:t]) * scale
            pred = head(embeds, inp, list(range(t)))  # predicts h_{i+1}
            # Per token: smooth L1 averaged over the hidden dimensions, as the EAGLE paper weighs it.
            # The regression covers every answer row (also those whose label is outside the draft
            # vocabulary, -100 for the cross-entropy).
            reg = F.smooth_l1_loss(pred[rows:], f[1 + rows:t + 1], reduction="sum") / f.shape[1]
            logits = F.linear(pred[rows:], lm_weight)
            first, second = _answer_targets(lab, start, t)
            target = first[rows:]
            cls = F.cross_entropy(logits, target, reduction="sum", ignore_index=-100)
            loss = reg + 0.1 * cls
            if second_draft and t - 1 > rows:
                pred2 = _second_drafts(head, embeds, inp, pred)[rows:]
                reg2 = F.smooth_l1_loss(pred2, f[2 + rows:t + 1], reduction="sum") / f.shape[1]
                cls2 = F.cross_entropy(F.linear(pred2, lm_weight), second[rows:], reduction="sum", ignore_index=-100)
                loss = loss + reg2 + 0.1 * cls2
            (loss / tokens_per_step).backward()
            pending += t - rows
            with torch.no_grad():
                sums["reg"] += float(reg)
                sums["cls"] += float(cls)
                sums["acc"] += float((logits.argmax(-1) == target).sum())
                sums["n"] += t - rows
                sums["valid"] += int((target >= 0).sum())
            if pending >= tokens_per_step or n == len(order) - 1:
                for group in opt.param_groups:
                    group["lr"] = lr * _cosine(step, steps, max(1, steps // 20))
                torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                pending, step = 0, step + 1
        m = max(1, sums["n"])
        v = max(1, sums["valid"])
        msg = (f"eagle epoch {epoch + 1}/{epochs}: smooth-L1 {sums['reg'] / m:.4f}, CE {sums['cls'] / v:.3f}, "
               f"top-1 {sums['acc'] / v:.2f}")
        if held_out and held_out[0]:
            acc1, acc2 = _eagle_accuracy(head, *held_out, loaded, lm_weight)
            msg += f", held out {acc1:.2f} (second draft {acc2:.2f})"
            if acc1 + acc2 > best[0]:
                best = (acc1 + acc2, {k: t.clone() for k, t in head.state_dict().items()})
        _log(msg)
    if best[1] is not None:
        head.load_state_dict(best[1])
    return head.eval()


# ---- the command ---------------------------------------------------------------------------
# Its arguments live in training.args, which imports no torch: every ``sluice`` command builds them.


def run(args) -> int:
    from sluice.engine.llm import LLM
    from sluice.engine.loaders import load_model
    from sluice.engine.spec_decode.heads import target_lm_weight
    from sluice.engine.training.save import save_eagle, save_medusa

    if args.threads:
        torch.set_num_threads(args.threads)
    if not 1 <= args.num_prompts <= MAX_PROMPTS:
        raise SystemExit(f"--num-prompts: must be in [1, {MAX_PROMPTS}], got {args.num_prompts}")
    t0 = time.perf_counter()
    corpus = Path(args.corpus) if args.corpus else None
    if corpus is not None and corpus.is_file():
        loaded = load_model(args.model, dtype="float32", device="cpu")
        sequences, starts = read_corpus(corpus)
    else:
        # Answering is the one sequential stage: in the format the model is served in (w4a8 decodes
        # SmolLM2 2.3x faster than float32 here), 64 at a time. The labels are always float32's:
        # a second, float32 copy is loaded only when the served format is not float32 itself.
        served = load_model(args.model, dtype="float32", device="cpu", quantization=args.corpus_quantization)
        llm = LLM(loaded=served, device="cpu", max_num_seqs=64,
                  **({"num_threads": args.threads} if args.threads else {}))
        sequences, starts = generate_corpus(llm, training_prompts(args.num_prompts, args.seed), args.max_tokens)
        _log(f"corpus answered in the {served.quantization} format")
        loaded = served if served.quantization == "none" else load_model(args.model, dtype="float32", device="cpu")
        del llm, served
        if corpus is not None:
            write_corpus(corpus, sequences, starts)
    answer_tokens = sum(len(q) - a for q, a in zip(sequences, starts))
    _log(f"corpus: {len(sequences)} conversations, {sum(map(len, sequences))} tokens, {answer_tokens} in the "
         f"answers ({time.perf_counter() - t0:.0f} s)")
    t1 = time.perf_counter()
    features = hidden_states(loaded, sequences, torch.device("cpu"), torch.float32)
    lm_weight = target_lm_weight(loaded.model).detach().float()
    labels = greedy_labels(features, lm_weight)
    _log(f"features and labels: {time.perf_counter() - t1:.0f} s")
    mask = None
    if 0 < args.draft_vocab < loaded.arch.vocab_size:
        # Drafts, and so the heads' training, only ever use these tokens; the labels of any other
        # token are left out of the cross-entropies.
        answers = [lab[a:] for lab, a in zip(labels, starts)]        # the choices drafts must match
        mask = draft_vocabulary(answers, loaded.arch.vocab_size, args.draft_vocab)
        _log(f"draft vocabulary: {args.draft_vocab} tokens cover "
             f"{float(mask[torch.cat(answers)].float().mean()):.1%} of the target's choices in the answers")
        remap = torch.full((loaded.arch.vocab_size,), -100, dtype=torch.long)
        remap[mask] = torch.arange(int(mask.sum()))
        lm_weight, labels = lm_weight[mask], [remap[lab] for lab in labels]
    # Every tenth conversation is held out: each kind keeps its epoch that predicts those best
    # (the heads memorise a small corpus quickly; what matters is prompts they never saw).
    held = set(range(9, len(sequences), 10)) if len(sequences) >= 10 else set()
    split = lambda items, keep: [x for i, x in enumerate(items) if (i in held) == keep]  # noqa: E731
    train_set = (split(features, False), split(labels, False), split(sequences, False), split(starts, False))
    held_set = (split(features, True), split(labels, True), split(sequences, True), split(starts, True))
    out = Path(args.out)
    kinds = ("medusa", "eagle") if args.kind == "both" else (args.kind,)
    for kind in kinds:
        t2 = time.perf_counter()
        folder = out / kind if args.kind == "both" else out
        if kind == "medusa":
            heads = train_medusa(train_set[0], train_set[1], train_set[3], lm_weight, args.medusa_heads,
                                 args.medusa_layers, args.medusa_epochs, seed=args.seed,
                                 held_out=(held_set[0], held_set[1], held_set[3]))
            heads.set_draft_vocab(mask)
            save_medusa(heads, folder, str(args.model))
        else:
            head = train_eagle(*train_set, loaded, lm_weight, args.eagle_epochs,
                               args.eagle_intermediate_size, seed=args.seed, held_out=held_set,
                               second_draft=not args.eagle_first_draft_only)
            head.set_draft_vocab(mask)
            save_eagle(head, folder, loaded.arch, str(args.model))
        _log(f"{kind}: trained in {time.perf_counter() - t2:.0f} s, written to {folder}")
    _log(f"done in {time.perf_counter() - t0:.0f} s")
    return 0


def main(argv=None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
