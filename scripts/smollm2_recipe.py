"""The SmolLM2 draft's data and training recipe: one command per stage, each a function of --seed.

    python scripts/smollm2_recipe.py prompts   --target GGUF --work W   # Magpie turns + seeds → W/prompts.*.jsonl
    python scripts/smollm2_recipe.py responses --target GGUF --work W   # the target answers → W/responses.jsonl
    python -m blockspec train-draft --target GGUF --data W/responses.jsonl --out W/draft ...   # (scripts/smollm2_device_run.sh)
    python scripts/smollm2_recipe.py measure   --target GGUF --work W --drafts W/draft,...      # → W/measure.json

prompts    Magpie (arXiv 2406.08464): the target writes user turns itself, sampled at temperature 1
           from its chat template's user prefix (system turn + "<|im_start|>user\\n"); plus seeds built
           here: code tasks, arithmetic and word problems with random numbers, rewriting tasks over
           the Magpie turns, and the templated prompts of smollm2_prompts.py. De-duplicated after
           normalising case, spaces and punctuation; a fixed share of the Magpie turns (by hash) is held
           out, and nothing equal to a held-out prompt (or to smollm2_prompts.HELD_OUT) is trained on.
responses  the target answers through our engine (plain decoding: no draft), many sequences at once:
           a greedy round over every prompt, with a follow-up turn (multi-turn) on a share of the
           greedy answers, then sampled rounds at temperature 0.7 (seeded per prompt), for
           --budget-s seconds of decoding; unfinished ones are dropped.
--workers  prompts and responses run as that many processes on one device, each an engine over a
           shard of the work (prompt i goes to shard i mod N; every seed is a function of i, so
           the data does not depend on N, only what a budget cuts does): one engine's host work
           per sequence and step bounds its tokens/s far below what the device decodes.
measure    held-out acceptance (greedy and at temperature 0.7) of each draft at each block size, DFlash ==
           plain on every greedy output, and plain vs DFlash output tok/s at --concurrency requests.
Runs on CPU at toy sizes (--magpie 8 --limit 16) to check the recipe before a device call.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import string
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from smollm2_prompts import HELD_OUT, TRAIN_TASKS, split, train_prompts  # noqa: E402

MASK_TOKEN = "<empty_output>"            # a special SmolLM2 never writes in chat: the draft's mask
SENTINELS = ("A", "B")                   # two user contents: their chat encodings part where the turn begins

LANGUAGES = ("Python", "JavaScript", "Java", "C", "C++", "Rust", "Go", "Bash", "SQL", "TypeScript")
CODE_ASKS = ("Write a {lang} function that {task}.", "How do I write {lang} code that {task}?",
             "Show me a {lang} program that {task}, and explain it.", "Write {lang} code that {task}, with comments.",
             "What is the simplest way in {lang} to write code that {task}?")
CODE_FIXES = ("Explain what this Python code does:\n\n{code}", "Find the bug in this Python code:\n\n{code}",
              "Rewrite this Python code to be more readable:\n\n{code}", "Add type hints to this Python code:\n\n{code}")
SNIPPETS = ("def f(xs):\n    return [x for x in xs if x % 2 == 0]",
            "for i in range(10):\n    print(i * i)",
            "def mean(xs):\n    return sum(xs) / len(xs)",
            "import json\nwith open('data.json') as f:\n    data = json.load(f)\nprint(data['name'])",
            "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)",
            "words = text.split()\ncounts = {}\nfor w in words:\n    counts[w] = counts.get(w, 0) + 1",
            "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n        self.items.append(x)",
            "def is_even(n):\n    if n % 2 == 0:\n        return True\n    else:\n        return False")
REWRITES = ("Rewrite this in a more formal tone: {text}", "Make this sentence shorter: {text}",
            "Fix the grammar and spelling: {text}", "Paraphrase the following: {text}",
            "Summarize this in one sentence: {text}", "Turn this into a bulleted list: {text}",
            "Rewrite this for a ten-year-old: {text}", "Translate this into French: {text}",
            "Make this sound more friendly: {text}", "Write a reply to this message: {text}")
FOLLOW_UPS = ("Can you give me an example?", "Can you explain that more simply?", "Make it shorter, please.",
              "Thanks! Can you tell me more?", "Can you put that in a list?", "Why is that?",
              "What are the main points again?", "Can you say that in a different way?",
              "What would be a good next step?", "Is there anything else I should know?")
NAMES = ("Alice", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemi", "Liam")
ITEMS = ("apples", "books", "pencils", "marbles", "cookies", "stickers", "cards", "oranges", "coins", "shells")


def log(message: str) -> None:
    print(f"[recipe {time.strftime('%H:%M:%S')}] {message}", flush=True)


def normalised(text: str) -> str:
    """The de-duplication key: lower case, punctuation dropped, spaces collapsed."""
    kept = text.lower().translate(str.maketrans("", "", string.punctuation))
    return " ".join(kept.split())


def held_out_by_hash(text: str, per_mille: int) -> bool:
    return int(hashlib.sha256(normalised(text).encode()).hexdigest()[:8], 16) % 1000 < per_mille


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> int:
    rows = list(rows)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)
    return len(rows)


# ---- the engine, stepped by us: many requests, a deadline ----

def open_llm(target: str, max_model_len: int, max_num_seqs: int, **options: Any):
    """An engine for the recipe. On CUDA its KV pool is what max_num_seqs sequences of
    max_model_len can use, not a share of the device's free memory: several engines start on
    one device at once (--workers) and each would see the others' memory as taken."""
    from blockspec.llm import LLM
    if options.get("device", "auto") != "cpu" and torch_cuda():
        pages_per_seq = -(-(max_model_len + 16) // 16)
        options = {"num_gpu_blocks": max_num_seqs * pages_per_seq + 1, **options}
    return LLM(target, max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_queue=1_000_000,
               show_progress=False, **options)


def torch_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def run_shards(args) -> None:
    """This stage again as args.workers processes, one per shard (--shard i), all at once."""
    command = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]]
    children = [subprocess.Popen(command + ["--shard", str(i)]) for i in range(args.workers)]
    failed = [i for i, child in enumerate(children) if child.wait() != 0]
    if failed:
        raise SystemExit(f"recipe: shards {failed} of {args.stage} failed")


def shards_of(args) -> list[int]:
    """The shards this process computes: its own (a worker), else all of them in-process (one
    worker), else none (the parent of --workers N, which merges what they wrote)."""
    if args.shard is not None:
        return [args.shard]
    if args.workers == 1:
        return [0]
    run_shards(args)
    return []


def run_requests(llm, jobs: list[tuple[list[int], Any, Any]], deadline: float, on_done=None) -> list[tuple[Any, Any]]:
    """jobs: (prompt ids, SamplingParams, tag). Steps the engine until every request finished or
    the deadline passed (the unfinished are aborted and left out). on_done(tag, request) may
    return more jobs (a follow-up turn). Returns (tag, request) of the finished ones, in the
    order they finished."""
    pending = list(reversed(jobs))
    running: dict[str, tuple[Any, Any]] = {}
    done: list[tuple[Any, Any]] = []
    count = 0

    def submit_some() -> None:
        nonlocal count
        # keep the queue shallow: the scheduler looks at every waiting request each step
        while pending and len(running) < 4 * llm.config.max_num_seqs:
            ids, params, tag = pending.pop()
            request = llm.make_request(f"r{count}", ids, params)
            count += 1
            llm.engine.submit(request, lambda event: None)
            running[request.request_id] = (tag, request)

    submit_some()
    while running and time.perf_counter() < deadline:
        llm.engine.step()
        for rid in [rid for rid, (_, r) in running.items() if r.is_finished]:
            tag, request = running.pop(rid)
            if request.finish_reason in ("stop", "length"):
                done.append((tag, request))
                if on_done is not None:
                    pending.extend(reversed(on_done(tag, request) or []))
        submit_some()
    for _, request in running.values():
        request.abort()
    return done


# ---- stage 1: prompts ----

def user_prefix(tokenizer) -> list[int]:
    """The chat encoding up to where the user's words begin (system turn + user header)."""
    a, b = (tokenizer.encode_chat([{"role": "user", "content": s}]) for s in SENTINELS)
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    return a[:common]


def magpie_turns(llm, indices: list[int], seed: int, deadline: float, max_tokens: int) -> list[tuple[int, str]]:
    """User turns the target writes itself (temperature 1; turn i seeded by i), kept when they end
    with the turn's end → (i, text)."""
    from blockspec.sampling import SamplingParams
    prefix = user_prefix(llm.tokenizer)
    jobs = [(prefix, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed * 1_000_003 + i), i)
            for i in indices]
    texts = []
    for i, request in run_requests(llm, jobs, deadline):
        if request.finish_reason != "stop":
            continue
        text = llm.tokenizer.decode(request.output_ids, skip_special_tokens=True).strip()
        if 3 <= len(text.split()) <= 200 and "<|" not in text:
            texts.append((i, text))
    return texts


def magpie_shard(args, shard: int) -> None:
    started = time.perf_counter()
    llm = open_llm(args.target, 512, args.max_num_seqs, **device_options(args))
    # The budget is decoding time: eight engines starting on one device took 30 s (the H200 run).
    turns = magpie_turns(llm, list(range(shard, args.magpie, args.workers)), args.seed,
                         time.perf_counter() + args.budget_s, args.magpie_tokens)
    write_jsonl(Path(args.work) / f"magpie.{shard}.jsonl", ({"i": i, "text": t} for i, t in turns))
    log(f"magpie shard {shard}: {len(turns)} turns kept ({time.perf_counter() - started:.0f} s)")


def math_prompts(rng: random.Random, count: int) -> list[str]:
    def one() -> str:
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 20)
        name, other, item = rng.choice(NAMES), rng.choice(NAMES), rng.choice(ITEMS)
        return rng.choice([
            f"What is {a} times {b}?", f"What is {a * c} divided by {c}?", f"Calculate {a} + {b} - {c}.",
            f"Solve for x: {c}x + {a} = {c * b + a}.", f"What is {c}% of {a * 10}?",
            f"Is {a * b + 1} a prime number?", f"What is the square of {a}?",
            f"{name} has {a} {item} and gives {min(a, c)} to {other}. How many {item} does {name} have left?",
            f"A shop sells {item} at ${c} each. How much do {a} {item} cost?",
            f"A train travels {a * c} km in {c} hours. What is its average speed?",
            f"{name} reads {c} pages a day. How many days to read a {a * c}-page book?",
            f"What is the perimeter of a rectangle {a} cm long and {b} cm wide?",
            f"What is the area of a circle with radius {c}?",
            f"Convert {a} kilometers to miles.", f"What is {a}/{b} as a decimal?",
            f"Explain step by step how to compute {a} * {b} in your head.",
        ])
    return [one() for _ in range(count)]


def seed_prompts(rng: random.Random, magpie: list[str], scale: int) -> list[str]:
    """Code, math and rewriting tasks (and the templated prompts of the first draft)."""
    tasks = split(TRAIN_TASKS)
    code = [rng.choice(CODE_ASKS).format(lang=rng.choice(LANGUAGES), task=rng.choice(tasks)) for _ in range(scale)]
    code += [template.format(code=snippet) for template in CODE_FIXES for snippet in SNIPPETS]
    sources = [t for t in magpie if len(t) < 400] or ["the meeting is moved to friday because the room is not free"]
    rewrites = [rng.choice(REWRITES).format(text=rng.choice(sources)) for _ in range(scale)]
    return code + math_prompts(rng, scale) + rewrites + train_prompts(rng.randint(0, 2**31))


def build_prompts(args) -> dict[str, Any] | None:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    for shard in shards_of(args):
        magpie_shard(args, shard)
    if args.shard is not None:
        return None
    turns = sorted((r["i"], r["text"]) for shard in range(args.workers)
                   for r in read_jsonl(work / f"magpie.{shard}.jsonl"))
    magpie = [text for _, text in turns]
    log(f"magpie: {len(magpie)} of {args.magpie} turns kept ({time.perf_counter() - started:.0f} s)")
    rng = random.Random(args.seed)
    seen = {normalised(p) for p in HELD_OUT}                     # the first draft's held-out set stays unseen
    train, held = [], []
    for text in magpie:
        key = normalised(text)
        if key in seen:
            continue
        seen.add(key)
        (held if held_out_by_hash(text, args.held_out_per_mille) else train).append(text)
    for text in seed_prompts(rng, train, args.seeds):
        key = normalised(text)
        if key not in seen:
            seen.add(key)
            train.append(text)
    rng.shuffle(train)
    write_jsonl(work / "prompts.train.jsonl", ({"messages": [{"role": "user", "content": p}]} for p in train))
    write_jsonl(work / "prompts.heldout.jsonl", ({"messages": [{"role": "user", "content": p}]} for p in held))
    stats = {"magpie_asked": args.magpie, "magpie_kept": len(magpie), "train": len(train), "held_out": len(held),
             "seconds": round(time.perf_counter() - started, 1), "workers": args.workers, "seed": args.seed}
    (work / "prompts.stats.json").write_text(json.dumps(stats, indent=1))
    log(json.dumps(stats))
    return stats


# ---- stage 2: responses ----

def build_responses(args) -> dict[str, Any] | None:
    work = Path(args.work)
    started = time.perf_counter()
    for shard in shards_of(args):
        respond_shard(args, shard)
    if args.shard is not None:
        return None
    rows = [row for shard in range(args.workers) for row in read_jsonl(work / f"responses.{shard}.jsonl")]
    write_jsonl(work / "responses.jsonl", rows)
    seconds = time.perf_counter() - started
    kinds: dict[str, int] = {}
    for row in rows:
        kinds[row["kind"]] = kinds.get(row["kind"], 0) + 1
    tokens = sum(len(r["token_ids"]) - r["prompt_len"] for r in rows)
    shards = [json.loads((work / f"responses.{shard}.stats.json").read_text()) for shard in range(args.workers)]
    stats = {"rows": len(rows), "response_tokens": tokens, "seconds": round(seconds, 1),
             "tok_s": round(tokens / seconds), "kinds": kinds, "prompts": sum(s["prompts"] for s in shards),
             "workers": args.workers, "decode_s": max(s["decode_s"] for s in shards),
             "decode_tok_s": round(tokens / max(s["decode_s"] for s in shards)), "seed": args.seed}
    (work / "responses.stats.json").write_text(json.dumps(stats, indent=1))
    log(json.dumps(stats))
    return stats


def respond_shard(args, shard: int) -> None:
    """The answers to prompts shard, shard + N, … (N = --workers): greedy first (with the
    follow-up turns as their first turns end), then the sampled rounds, until the budget ends."""
    from blockspec.sampling import SamplingParams
    work = Path(args.work)
    started = time.perf_counter()
    llm = open_llm(args.target, args.seq_len, args.max_num_seqs, **device_options(args))
    loaded = time.perf_counter()
    tokenizer = llm.tokenizer
    messages = [r["messages"] for r in read_jsonl(work / "prompts.train.jsonl")][: args.limit]
    rng = random.Random(args.seed)
    follow = set(rng.sample(range(len(messages)), int(len(messages) * args.follow_up_share)))
    chats = {i: (messages[i], tokenizer.encode_chat(messages[i])) for i in range(shard, len(messages), args.workers)}
    chats = {i: (m, ids) for i, (m, ids) in chats.items() if len(ids) < args.seq_len // 2}

    def params(prompt_len: int, temperature: float, seed: int | None) -> SamplingParams:
        return SamplingParams(max_tokens=min(args.max_response, args.seq_len - prompt_len), temperature=temperature,
                              seed=seed)
    greedy = [(ids, params(len(ids), 0.0, None), ("greedy", i)) for i, (_, ids) in chats.items()]
    sampled = []
    for r, temperature in enumerate(args.temperatures):
        order = list(range(len(messages)))
        random.Random(args.seed + 1 + r).shuffle(order)
        sampled += [(chats[i][1], params(len(chats[i][1]), temperature, args.seed * 7_919 + r * 1_000_003 + i),
                     (f"t{temperature}", i)) for i in order if i in chats]
    # A budget cuts the run short: with --sampled-share > 0, sampled answers ride along at that
    # share of the greedy ones from the start, so a cut run still has both kinds.
    every = max(1, round(1 / args.sampled_share)) if args.sampled_share > 0 else len(greedy) + 1
    jobs, riding = [], iter(sampled)
    for n, job in enumerate(greedy):
        jobs.append(job)
        if n % every == every - 1:
            jobs += [next(riding)] if sampled else []
    jobs += list(riding)

    def follow_up(tag, request):
        kind, i = tag
        if kind != "greedy" or i not in follow or request.finish_reason != "stop":
            return []
        answer = tokenizer.decode(request.output_ids, skip_special_tokens=True)
        turn = chats[i][0] + [{"role": "assistant", "content": answer},
                              {"role": "user", "content": FOLLOW_UPS[i % len(FOLLOW_UPS)]}]
        ids = tokenizer.encode_chat(turn)
        return [(ids, params(len(ids), 0.0, None), ("follow-up", i))] if len(ids) < args.seq_len - 32 else []
    done = run_requests(llm, jobs, loaded + args.budget_s, follow_up)
    rows = [{"token_ids": r.prompt_ids + r.output_ids, "prompt_len": len(r.prompt_ids), "kind": tag[0]}
            for tag, r in done]
    write_jsonl(work / f"responses.{shard}.jsonl", rows)
    decode_s = time.perf_counter() - loaded
    tokens = sum(len(r["token_ids"]) - r["prompt_len"] for r in rows)
    stats = {"shard": shard, "rows": len(rows), "response_tokens": tokens, "prompts": len(chats),
             "load_s": round(loaded - started, 1), "decode_s": round(decode_s, 1), "tok_s": round(tokens / decode_s)}
    (work / f"responses.{shard}.stats.json").write_text(json.dumps(stats))
    log(json.dumps(stats))


# ---- stage 4: measure ----

def held_out_chats(work: Path, tokenizer, limit: int, names: list[str]) -> dict[str, list[list[int]]]:
    """The held-out sets named: chat, the first draft's chat prompts; magpie, the Magpie turns
    held out by hash."""
    sets = {"chat": [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in HELD_OUT]}
    path = work / "prompts.heldout.jsonl"
    if path.exists():
        sets["magpie"] = [tokenizer.encode_chat(r["messages"]) for r in read_jsonl(path)][:limit]
    return {k: v[:limit] for k, v in sets.items() if v and k in names}


def acceptance(llm, prompts: list[list[int]], temperature: float, max_tokens: int, seed: int):
    from blockspec.sampling import SamplingParams
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature,
                             seed=None if temperature == 0 else seed + i) for i in range(len(prompts))]
    results = llm.generate(prompts, params)
    lengths = [a for r in results for a in r.stats.acceptance_lengths]
    return sum(lengths) / max(1, len(lengths)), results


def tok_s(llm, prompts: list[list[int]], concurrency: int, max_tokens: int, rounds: int,
          first: int = 0, warm: bool = True) -> float:
    """Output tok/s of `concurrency` requests decoded together, `rounds` batches of other prompts
    (greedy, max_tokens each; after a warm-up batch that captures the graphs, unless warm=False),
    starting at batch `first` of the prompts."""
    from blockspec.sampling import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def batch(r: int) -> list[list[int]]:
        return [prompts[(r * concurrency + i) % len(prompts)] for i in range(concurrency)]
    if warm:
        llm.generate(batch(first + rounds), params)
    started, tokens = time.perf_counter(), 0
    for r in range(first, first + rounds):
        tokens += sum(len(out.token_ids) for out in llm.generate(batch(r), params))
    return tokens / (time.perf_counter() - started)


def measure(args) -> dict[str, Any]:
    """Drafts in the order given; tok/s of the best so far once every draft but the last (the
    shipped one, a baseline) is measured. measure.json is rewritten after each piece, so a run
    cut by its time limit keeps what it measured."""
    work = Path(args.work)
    opts = device_options(args)
    plain = open_llm(args.target, 1024, 64, **opts)
    sets = held_out_chats(work, plain.tokenizer, args.limit, args.sets)
    reference = {name: [r.token_ids for r in acceptance(plain, prompts, 0.0, args.max_tokens, 0)[1]]
                 for name, prompts in sets.items()}
    report: dict[str, Any] = {"max_tokens": args.max_tokens, "held_out": {k: len(v) for k, v in sets.items()},
                              "drafts": {}}
    best: dict[str, Any] = {"chat_greedy": 0.0}

    def save() -> None:
        report["best"] = best
        (work / "measure.json").write_text(json.dumps(report, indent=1))
    for number, draft in enumerate(args.drafts):
        if number == len(args.drafts) - 1 and len(args.drafts) > 1 and args.concurrency:
            report["tok_s"] = speeds(args, sets["chat"], best, opts)
            save()
        native = json.loads((Path(draft) / "config.json").read_text())["block_size"]
        for block in sorted({b for b in args.block_sizes if b <= native} | {native}, reverse=True):
            llm = open_llm(args.target, 1024, 64, draft=draft, block_size=block, speculation="fixed", **opts)
            row: dict[str, Any] = {}
            for name, prompts in sets.items():
                greedy, results = acceptance(llm, prompts, 0.0, args.max_tokens, 0)
                sampled, _ = acceptance(llm, prompts, 0.7, args.max_tokens, args.seed)
                equal = sum(r.token_ids == ref for r, ref in zip(results, reference[name]))
                row[name] = {"greedy": round(greedy, 3), "t0.7": round(sampled, 3), "equal": f"{equal}/{len(prompts)}"}
            report["drafts"].setdefault(draft, {})[str(block)] = row
            log(f"{draft} block {block}: {json.dumps(row)}")
            if row["chat"]["greedy"] > best["chat_greedy"] and number < len(args.drafts) - 1:
                best = {"draft": draft, "block_size": block, "chat_greedy": row["chat"]["greedy"]}
            del llm
            save()
    if len(args.drafts) == 1 and args.concurrency:
        report["tok_s"] = speeds(args, sets["chat"], best, opts)
    save()
    log(json.dumps(report))
    return report


def speeds(args, prompts: list[list[int]], best: dict[str, Any], opts: dict[str, Any]) -> dict[str, Any]:
    """Plain vs DFlash (the best draft and block; every draft verified, and --speculation
    adaptive) output tok/s at each concurrency, the three engines side by side."""
    if "draft" not in best:
        return {}
    size = max(args.concurrency)
    engines = {mode: open_llm(args.target, 1024, size, draft=best["draft"], block_size=best["block_size"],
                              speculation=mode, **opts) for mode in ("fixed", "adaptive")}
    base = open_llm(args.target, 1024, size, **opts)
    speed: dict[str, Any] = {"draft": best["draft"], "block_size": best["block_size"]}
    for c in args.concurrency:
        # Interleaved rounds, each a batch of other prompts for all three engines in turn, and the
        # median of each engine's: one batch at 16 or 64 requests lasts ~0.2–1 s on the H200, and
        # runs of one mode spread ±5 % (round 45), more than the margins asked of adaptive.
        rounds = args.rounds
        batches = 4 if c == 1 else 1
        runs: dict[str, list[float]] = {"plain": [], "fixed": [], "adaptive": []}
        for llm in (base, *engines.values()):
            tok_s(llm, prompts, c, args.max_tokens, 1, first=rounds * batches)           # warm-up
        for r in range(rounds):
            for name, llm in (("plain", base), *engines.items()):
                runs[name].append(tok_s(llm, prompts, c, args.max_tokens, batches, first=r * batches, warm=False))
        p = statistics.median(runs["plain"])
        row: dict[str, Any] = {"plain": round(p, 1)}
        for mode in engines:
            d = statistics.median(runs[mode])
            name = "dflash" if mode == "fixed" else mode
            row[name], row[f"{name}_speedup"] = round(d, 1), round(d / p, 3)
        row["rounds"] = {name: [round(x, 1) for x in xs] for name, xs in runs.items()}
        speed[str(c)] = row
        log(f"c={c}: {row}")
    return speed


def device_options(args) -> dict[str, Any]:
    return {"device": args.device, "dtype": args.dtype, "threads": args.threads}


def floats(text: str) -> list[float]:
    return [float(t) for t in text.split(",") if t.strip()]


def ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="stage", required=True)
    stages = {name: sub.add_parser(name) for name in ("prompts", "responses", "measure")}
    for p in stages.values():
        p.add_argument("--target", required=True, help="the SmolLM2 GGUF file")
        p.add_argument("--work", required=True)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--device", default="auto")
        p.add_argument("--dtype", default="auto")
        p.add_argument("--threads", type=int, default=1)
        p.add_argument("--limit", type=int, default=None, help="at most this many prompts (a toy run)")
    p = stages["prompts"]
    p.add_argument("--magpie", type=int, default=20_000, help="user turns asked of the target")
    p.add_argument("--magpie-tokens", type=int, default=96)
    p.add_argument("--seeds", type=int, default=4_000, help="code, math and rewriting prompts each")
    p.add_argument("--held-out-per-mille", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=60, help="seconds of decoding, after the engine starts")
    p.add_argument("--max-num-seqs", type=int, default=512)
    p = stages["responses"]
    p.add_argument("--seq-len", type=int, default=384)
    p.add_argument("--max-response", type=int, default=320)
    p.add_argument("--temperatures", type=floats, default=[0.7, 0.7], help="sampled rounds after the greedy one")
    p.add_argument("--follow-up-share", type=float, default=0.25, help="greedy answers that get a second turn")
    p.add_argument("--sampled-share", type=float, default=0.0,
                   help="sampled answers per greedy one, while both last (0: every greedy answer first)")
    p.add_argument("--budget-s", type=float, default=150, help="seconds of decoding, after the engine starts")
    p.add_argument("--max-num-seqs", type=int, default=512)
    p = stages["measure"]
    p.add_argument("--drafts", type=lambda t: [d for d in t.split(",") if d], required=True)
    p.add_argument("--block-sizes", type=ints, default=[8, 16])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=ints, default=[1, 16, 64])
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds of plain, fixed and adaptive (tok/s: medians)")
    p.add_argument("--sets", type=lambda t: [n for n in t.split(",") if n], default=["chat", "magpie"],
                   help="held-out sets: chat (smollm2_prompts.HELD_OUT), magpie (the turns held out by hash)")
    for name in ("prompts", "responses"):
        stages[name].add_argument("--workers", type=int, default=1, help="processes (engines) on the device")
        stages[name].add_argument("--shard", type=int, default=None, help=argparse.SUPPRESS)   # a worker's own
    args = parser.parse_args()
    {"prompts": build_prompts, "responses": build_responses, "measure": measure}[args.stage](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
