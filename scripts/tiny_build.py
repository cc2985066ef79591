"""How the embedded "tiny" model and the example data were made: build tooling, not part of the package.

The shipped checkpoint in backends/local/assets/tiny/ is pre-trained (full fine-tune, plain torch) on synthetic
chats generated here, so that it knows the ChatML format, a few string skills and small sums, and is only
partly right on 2-digit sums (the RL example's task). The example data in examples/data/ (SFT chats about a
made-up world, DPO preference pairs, labelled comparisons) is generated here too. Regenerate them with:

    python -m scripts.tiny_build build [--out DIR] [--seed S]   # 1600 steps; bit-identical on one machine
    python -m scripts.tiny_build data [--out DIR]

What runs with the package (the tokenizer, config and prompts) is backends/local/tiny.py.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import transformers

from backends.local.tiny import (
    IM_END,
    IM_START,
    TINY_DIR,
    _arith_task,
    _save,
    _short_task,
    _string_task,
    arithmetic_prompt,
    build_config,
    build_tokenizer,
)

# ---------------------------------------------------------------- synthetic pre-training data

SYSTEMS = ("You are a helpful assistant.", "You are a concise assistant.", "Answer briefly.")
UPPER_SYSTEM = "Always answer in uppercase."



def pretrain_conversation(rng: random.Random, arith_frac: float = 0.35, wide_frac: float = 0.3) -> list[dict]:
    """One synthetic chat: 1-3 turns, sometimes with a system message (which may ask for uppercase)."""
    messages: list[dict] = []
    upper = False
    r = rng.random()
    if r < 0.1:
        messages.append({"role": "system", "content": UPPER_SYSTEM})
        upper = True
    elif r < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEMS)})
    # Mostly single turns: multi-turn chats are long, and pre-training time is the budget that matters.
    turns = 1 if rng.random() < 0.85 else rng.choice((2, 2, 3))
    for _ in range(turns):
        r = rng.random()
        if r < arith_frac:
            user, answer = _arith_task(rng, wide_frac)
        elif r < arith_frac + (1 - arith_frac) * 0.7:
            user, answer = _string_task(rng)
        else:
            user, answer = _short_task(rng)
        messages.append({"role": "user", "content": user})
        messages.append({"role": "assistant", "content": answer.upper() if upper else answer})
    return messages


def render_chat(tok, messages: list[dict]) -> tuple[list[int], list[float]]:
    """ChatML tokens of a conversation and per-token weights: 1 on assistant content and its <|im_end|>
    (what the model must produce), 0 elsewhere. Byte-level, so segments tokenize independently."""
    ids: list[int] = []
    weights: list[float] = []
    start, end, nl = tok.convert_tokens_to_ids([IM_START, IM_END, "Ċ"])
    for m in messages:
        head = [start, *tok.encode(m["role"] + "\n", add_special_tokens=False)]
        body = [*tok.encode(m["content"], add_special_tokens=False), end]
        w = 1.0 if m["role"] == "assistant" else 0.0
        ids += head + body + [nl]
        weights += [0.0] * len(head) + [w] * len(body) + [0.0]
    return ids, weights


# ---------------------------------------------------------------- pre-training (plain torch, full fine-tune)

def _batches(tok, rng: random.Random, batch: int, n_batches: int, **mix) -> list[tuple]:
    """n_batches batches of rendered chats; drawn together and sorted by length so padding stays small."""
    import torch

    rows = [render_chat(tok, pretrain_conversation(rng, **mix)) for _ in range(batch * n_batches)]
    rows.sort(key=lambda r: len(r[0]))
    out = []
    pad = tok.pad_token_id
    for i in range(0, len(rows), batch):
        chunk = rows[i : i + batch]
        n = max(len(ids) for ids, _ in chunk)
        ids_BT = torch.tensor([ids + [pad] * (n - len(ids)) for ids, _ in chunk])
        w_BT = torch.tensor([w + [0.0] * (n - len(w)) for _, w in chunk])
        out.append((ids_BT, w_BT))
    rng.shuffle(out)
    return out


# (steps, peak lr, arithmetic share, share of arithmetic on [0, 99] operands, linear decay to 0).
# The general mix learns the format, the string skills and small sums, but 2-digit sums only slowly;
# an arithmetic-heavy phase and a short cooldown bring those into the partly-correct range RL improves.
PHASES = ((900, 5e-3, 0.6, 0.5, False), (400, 5e-3, 0.9, 0.7, False), (300, 2e-3, 0.9, 0.7, True))


def pretrain(out: Path, phases=PHASES, seed: int = 0, threads: int = 1, log_every: int = 100,
             callback: Callable[[int, Any], None] | None = None) -> Path:
    """Build the tiny checkpoint from scratch: one `train_phase` per entry of `phases`, each with a fresh
    optimizer and its own data seed. Full fine-tune, loss on assistant tokens only."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    tok = build_tokenizer()
    model = transformers.AutoModelForCausalLM.from_config(build_config(tok))
    done = 0
    for i, (steps, lr, arith_frac, wide_frac, decay) in enumerate(phases):
        train_phase(model, tok, random.Random(seed + i), steps, lr=lr, arith_frac=arith_frac, wide_frac=wide_frac,
                    decay=decay, log_every=log_every, callback=callback, step_offset=done)
        done += steps
    model.eval()
    _save(model, tok, Path(out))
    return Path(out)


def train_phase(model, tok, rng: random.Random, steps: int, *, arith_frac: float, wide_frac: float,
                batch: int = 32, lr: float = 5e-3, decay: bool = False, log_every: int = 100,
                callback: Callable[[int, Any], None] | None = None, step_offset: int = 0) -> None:
    """`steps` AdamW steps on freshly drawn synthetic chats. `callback(step, model)` runs at each log."""
    import time

    import torch

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    # Warmup, then constant (or linear decay to 0). Constant phases make every prefix of a run a complete
    # build, so one long run with evaluations showed which step counts give the wanted partial accuracy.
    warmup = 50 if not decay else 20
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (1.0 - s / steps if decay else 1.0)
    )
    queue: list[tuple] = []
    t0, total = time.time(), 0.0
    for step in range(steps):
        if not queue:
            queue = _batches(tok, rng, batch, 8, arith_frac=arith_frac, wide_frac=wide_frac)
        ids_BT, w_BT = queue.pop()
        # bf16 autocast: measured up to 1.5x faster than fp32 on this CPU; weights and optimizer stay fp32.
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits_BTV = model(input_ids=ids_BT[:, :-1]).logits
        nll_BT = torch.nn.functional.cross_entropy(
            logits_BTV.float().transpose(1, 2), ids_BT[:, 1:], reduction="none"
        )
        w = w_BT[:, 1:]
        loss = (nll_BT * w).sum() / w.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        total += loss.item()
        if (step + 1) % log_every == 0:
            model.eval()
            acc = eval_arithmetic(model, tok, n=200)["accuracy"]
            model.train()
            print(f"step {step_offset + step + 1} loss {total / log_every:.4f} "
                  f"arithmetic greedy accuracy {acc:.3f} ({time.time() - t0:.0f}s)", flush=True)
            total = 0.0
            if callback is not None:
                callback(step_offset + step + 1, model)
    model.eval()


def generate(model, tok, prompts: list[list[dict]], temperature: float = 0.0, max_new: int = 8,
             seed: int = 0) -> list[tuple[str, bool]]:
    """Replies (text, ended_with_eos) to chat prompts; greedy when temperature is 0. No KV cache: the
    replies are a few tokens, so re-running the short prompt is cheaper than the bookkeeping."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    eos = tok.eos_token_id
    encoded = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    encoded = [tok.encode(e, add_special_tokens=False) for e in encoded]
    results: list[tuple[str, bool]] = [("", False)] * len(prompts)
    by_len: dict[int, list[int]] = {}
    for i, ids in enumerate(encoded):
        by_len.setdefault(len(ids), []).append(i)
    with torch.no_grad():
        for idx in by_len.values():
            seq_BT = torch.tensor([encoded[i] for i in idx])
            done_B = torch.zeros(len(idx), dtype=torch.bool)
            out_BT = []
            for _ in range(max_new):
                logits_BV = model(input_ids=seq_BT).logits[:, -1].float()
                if temperature == 0:
                    nxt_B = logits_BV.argmax(-1)
                else:
                    nxt_B = torch.multinomial(torch.softmax(logits_BV / temperature, -1), 1, generator=gen)[:, 0]
                nxt_B = torch.where(done_B, torch.full_like(nxt_B, eos), nxt_B)
                out_BT.append(nxt_B)
                done_B |= nxt_B == eos
                seq_BT = torch.cat([seq_BT, nxt_B[:, None]], 1)
                if done_B.all():
                    break
            for row, i in enumerate(idx):
                toks = [int(t[row]) for t in out_BT]
                ended = eos in toks
                toks = toks[: toks.index(eos)] if ended else toks
                results[i] = (tok.decode(toks), ended)
    return results


def eval_arithmetic(model, tok, n: int = 400, hi: int = 99, temperature: float = 0.0, seed: int = 1) -> dict:
    """Accuracy, format rate (integer reply ending in <|im_end|>) and mean RL reward
    (correct + 0.1 * (format_ok - 1)) on x, y uniform in [0, hi]."""
    rng = random.Random(seed)
    pairs = [(rng.randint(0, hi), rng.randint(0, hi)) for _ in range(n)]
    replies = generate(model, tok, [[{"role": "user", "content": arithmetic_prompt(x, y)}] for x, y in pairs],
                       temperature=temperature, seed=seed)
    correct = fmt = 0.0
    for (x, y), (text, ended) in zip(pairs, replies):
        ok = ended and text.strip().lstrip("-").isdigit()
        fmt += ok
        correct += ok and int(text) == x + y
    return {"accuracy": correct / n, "format": fmt / n, "reward": (correct + 0.1 * (fmt - n)) / n}


# ---------------------------------------------------------------- shipped SFT / DPO data (examples/data/)
# The SFT task is new to the pre-trained model: facts about a made-up world, Veloria, told by a persona.
# Pre-training never shows these words, so SFT has a lot to learn and its loss drop is easy to see.

PERSONA = "You are Pip, the guide of Veloria."
CREATURES = ("zorbit", "mellow", "quastle", "fennip", "glimmerhorn", "trundle", "skarr", "oomph",
             "vexle", "brindle", "plunk", "wisp", "drako", "nubbin", "toller", "yarrow")
COLORS = ("blue", "green", "silver", "orange", "purple", "golden", "red", "white")
PLACES = ("the Misty Hills", "Lake Orro", "the Glass Forest", "Ember Valley", "the Salt Caves", "Port Lumen")
FOODS = ("moonberries", "river stones", "sugar moss", "copper leaves", "cloud fruit", "tiny fish")


def _world(rng: random.Random) -> dict[str, dict[str, str]]:
    return {c: {"color": rng.choice(COLORS), "home": rng.choice(PLACES), "food": rng.choice(FOODS),
                "legs": str(rng.choice((2, 4, 6, 8)))} for c in CREATURES}


def _fact_qa(rng: random.Random, world: dict, creature: str, attr: str) -> tuple[str, str, str]:
    """(question, true answer, a wrong answer) about one attribute of one creature."""
    f = world[creature]
    wrong = {"color": COLORS, "home": PLACES, "food": FOODS, "legs": ("2", "4", "6", "8")}[attr]
    bad = rng.choice([v for v in wrong if v != f[attr]])
    an = "an" if creature[0] in "aeiou" else "a"
    q, a = {
        "color": (rng.choice((f"What color is {an} {creature}?", f"Which color are {creature}s?")), "{An} {c} is {v}."),
        "home": (rng.choice((f"Where does the {creature} live?", f"Where can I find {an} {creature}?")),
                 "The {c} lives in {v}."),
        "food": (rng.choice((f"What does {an} {creature} eat?", f"What do {creature}s like to eat?")),
                 "{An} {c} eats {v}."),
        "legs": (rng.choice((f"How many legs does {an} {creature} have?", f"Count the legs of {an} {creature}.")),
                 "{An} {c} has {v} legs."),
    }[attr]
    return q, a.format(An=an.title(), c=creature, v=f[attr]), a.format(An=an.title(), c=creature, v=bad)


def sft_conversations(n: int = 480, seed: int = 0) -> list[dict]:
    """Chats about Veloria: 1-3 fact questions, half with Pip's persona as the system message."""
    rng = random.Random(seed)
    world = _world(random.Random(1234))  # the world is fixed; `seed` only changes which questions are asked
    rows = []
    for _ in range(n):
        messages: list[dict] = []
        if rng.random() < 0.5:
            messages.append({"role": "system", "content": PERSONA})
        if rng.random() < 0.15:
            messages += [{"role": "user", "content": rng.choice(("Who are you?", "Hello! Who is this?"))},
                         {"role": "assistant", "content": "I am Pip, the guide of Veloria. Ask me about its creatures."}]
        for _ in range(1 if rng.random() < 0.6 else rng.randint(2, 3)):
            q, a, _ = _fact_qa(rng, world, rng.choice(CREATURES), rng.choice(("color", "home", "food", "legs")))
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        rows.append({"messages": messages})
    return rows


def preference_rows(n: int = 200, seed: int = 0) -> list[dict]:
    """DPO pairs: chosen is correct and concise; rejected is wrong, or right but padded with filler."""
    rng = random.Random(seed)
    world = _world(random.Random(1234))
    filler = ("Well, that is a great question, let me think about it carefully. ", "Hmm, I believe that ",
              "Let me see. After some thought, ")
    rows = []
    for i in range(n):
        prompt: list[dict] = [{"role": "system", "content": PERSONA}] if rng.random() < 0.3 else []
        if i % 2 == 0:
            x, y = rng.randint(0, 99), rng.randint(0, 99)
            q, good = arithmetic_prompt(x, y), str(x + y)
            bad = str(x + y + rng.choice((-10, -2, -1, 1, 2, 10))) if rng.random() < 0.5 else rng.choice(filler) + good
        else:
            q, good, wrong = _fact_qa(rng, world, rng.choice(CREATURES), rng.choice(("color", "home", "food", "legs")))
            bad = wrong if rng.random() < 0.5 else rng.choice(filler) + good[0].lower() + good[1:]
        prompt.append({"role": "user", "content": q})
        rows.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": good}],
                     "rejected": [{"role": "assistant", "content": bad}]})
    return rows


def comparison_rows(n: int = 600, seed: int = 0) -> list[dict]:
    """Labelled comparisons in the cookbook's format ({"comparison": {prompt_conversation, completion_A,
    completion_B}, "label": "A" | "B" | "Tie"}), on skills the pre-trained model has, so a preference is
    learnable: single-digit sums and string tasks, where the better answer is the right one, concise, and the worse
    one is wrong (40%), the right answer padded with filler (40%) or no answer at all (20%). The better side is A or
    B at random; about 5% of the rows are ties (two wrong answers), which DPO and the reward model drop."""
    rng = random.Random(seed)
    filler = ("Well, that is a great question, let me think about it carefully. ", "Hmm, I believe that ",
              "Let me see. After some thought, ", "Okay, so, to answer your question, ")
    evasive = ("I am not sure.", "I cannot help with that.", "Ask me something else.", "That is hard to say.")
    rows = []
    for _ in range(n):
        prompt: list[dict] = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.2 else []
        if rng.random() < 0.5:
            x, y = rng.randint(0, 9), rng.randint(0, 9)
            q, good = arithmetic_prompt(x, y), str(x + y)
            wrong = [str(v) for v in range(max(0, x + y - 3), x + y + 4) if v != x + y]
        else:
            while True:
                q, good = _string_task(rng)
                # Sorted: a set's order changes with the process's string hash seed.
                wrong = sorted({good[::-1], good.upper(), good[1:], good + good[-1], "".join(sorted(good))} - {good, ""})
                if wrong:
                    break
        r = rng.random()
        if r < 0.05:
            better, worse, label = rng.choice(wrong), rng.choice(filler) + rng.choice(wrong), "Tie"
        elif r < 0.43:
            better, worse, label = good, rng.choice(wrong), "A"
        elif r < 0.81:
            better, worse, label = good, rng.choice(filler) + good, "A"
        else:
            better, worse, label = good, rng.choice(evasive), "A"
        if rng.random() < 0.5:
            better, worse = worse, better
            label = {"A": "B", "Tie": "Tie"}[label]
        prompt.append({"role": "user", "content": q})
        rows.append({"comparison": {"prompt_conversation": prompt,
                                    "completion_A": [{"role": "assistant", "content": better}],
                                    "completion_B": [{"role": "assistant", "content": worse}]},
                     "label": label})
    return rows


def write_data(out_dir: Path) -> list[Path]:
    """Write chat_sft.jsonl, preferences.jsonl and comparisons.jsonl (deterministic)."""
    import json

    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"chat_sft.jsonl": sft_conversations(), "preferences.jsonl": preference_rows(),
             "comparisons.jsonl": comparison_rows()}
    for name, rows in files.items():
        with open(out_dir / name, "w") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    return [out_dir / name for name in files]


def main(argv: list[str] | None = None) -> None:
    import argparse
    import time

    repo = Path(__file__).resolve().parents[1]
    p = argparse.ArgumentParser(prog="python -m scripts.tiny_build")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="pre-train the shipped checkpoint from scratch")
    b.add_argument("--out", type=Path, default=TINY_DIR)
    b.add_argument("--seed", type=int, default=0)
    d = sub.add_parser("data", help="write the example SFT and preference data")
    d.add_argument("--out", type=Path, default=repo / "examples" / "data")
    args = p.parse_args(argv)
    if args.cmd == "data":
        for path in write_data(args.out):
            print(path)
        return
    t0 = time.time()
    out = pretrain(args.out, seed=args.seed)
    print(f"saved {out} in {time.time() - t0:.0f}s")
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    for temperature in (0.0, 1.0):
        wide = eval_arithmetic(model, tok, temperature=temperature)
        small = eval_arithmetic(model, tok, hi=9, n=100, temperature=temperature)
        print(f"T={temperature}: x,y in [0,99] {wide}; x,y in [0,9] {small}")


if __name__ == "__main__":
    main()
