"""The training loop of `blockspec train-draft`.

One step: take the global batch of this step (data.batch_indices), each rank its slice; run the
frozen target once over the sequences for context features; draft all anchors' blocks in one
forward (blockwise.py); loss = Σ weight · CE over the global batch / Σ weight; gradients are
summed over ranks, so N processes compute what one process would on the same global batch.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from blockspec.train import blockwise, checkpoint, data, features

if TYPE_CHECKING:
    from blockspec.tokenizer import Tokenizer

MASK_TOKEN_NAMES = ("<|mask|>", "<mask>", "[MASK]", "<|MASK|>")
PAD_TOKEN_NAMES = ("<|fim_pad|>", "<|pad|>", "<pad>", "[PAD]")
# Settings that must match for --resume to continue the same run (steps may grow).
RUN_KEYS = ("target", "data", "num_layers", "block_size", "target_layer_ids", "mask_token_id",
            "batch_size", "lr", "seq_len", "num_anchors", "seed", "labels", "init_from")
# What slot k of the block at anchor a learns: the row's own token at a + k, the target's greedy
# choice there, teacher-forced on the row, or the target's distribution there (its DISTILL_TOP
# likeliest tokens, renormalised: distillation, each position teaching the draft the target's
# whole ranking rather than one token). The first two are the same on greedy rows; on sampled
# rows the row's token is often not what greedy verification accepts (BENCHMARKS.md, issue 32).
LABELS = ("tokens", "target", "distill")
# The target's tokens kept per position for --labels distill: a small model's next-token mass is
# nearly all in its top few dozen, and B · L · V probabilities would not fit beside the draft.
DISTILL_TOP = 32


class TrainError(ValueError):
    """A bad train-draft setting; the message says which and what to do."""


@dataclass(frozen=True)
class TrainConfig:
    target: str
    out: str
    data: str | None = None             # None: the Python standard library's source
    eval_data: str | None = None
    num_layers: int = 1
    block_size: int = 16
    target_layer_ids: tuple[int, ...] | None = None
    mask_token_id: int | None = None
    steps: int = 1000
    batch_size: int = 8                 # global: sequences per step over all processes
    lr: float = 6e-4
    seq_len: int = 512
    num_anchors: int | None = None      # per sequence; default seq_len / block_size
    device: str = "auto"
    resume: bool = False
    eval_every: int = 200               # 0: evaluate only at the end
    eval_prompts: int = 8               # 0: never evaluate
    eval_tokens: int = 128
    save_every: int = 500
    seed: int = 0
    show_progress: bool = True
    max_seconds: float | None = None    # stop (saving a checkpoint and the draft) after this long
    labels: str = "tokens"              # LABELS
    init_from: str | None = None        # a draft directory whose weights start the run (its own schedule)

    def __post_init__(self) -> None:
        positive = {"--num-layers": self.num_layers, "--steps": self.steps, "--batch-size": self.batch_size,
                    "--eval-tokens": self.eval_tokens}
        for flag, value in positive.items():
            if value < 1:
                raise TrainError(f"{flag} must be at least 1, got {value}")
        if self.block_size < 2:
            raise TrainError(f"--block-size must be at least 2 (a block of 1 drafts nothing), got {self.block_size}")
        if self.seq_len < self.block_size + 2:
            raise TrainError(f"--seq-len {self.seq_len} is too short for --block-size {self.block_size}")
        if not self.lr > 0:
            raise TrainError(f"--lr must be positive, got {self.lr}")
        if min(self.eval_every, self.save_every, self.eval_prompts) < 0:
            raise TrainError("--eval-every, --save-every and --eval-prompts must be at least 0")
        if self.num_anchors is not None and self.num_anchors < 1:
            raise TrainError(f"--num-anchors must be at least 1, got {self.num_anchors}")
        if self.labels not in LABELS:
            raise TrainError(f"--labels must be one of {', '.join(LABELS)}, got {self.labels!r}")
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise TrainError(f"--max-seconds must be positive, got {self.max_seconds}")

    @property
    def anchors_per_seq(self) -> int:
        return self.num_anchors or blockwise.default_num_anchors(self.seq_len, self.block_size)


@dataclass
class Ranks:
    rank: int
    world: int
    device: torch.device

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def init_ranks(device: str) -> Ranks:
    """torchrun sets WORLD_SIZE/RANK/LOCAL_RANK: NCCL on GPUs (one per process), gloo on CPU."""
    from blockspec.loader import resolve_device
    torch_device = resolve_device(device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Ranks(0, 1, torch_device)
    if torch_device.type == "cuda":
        torch_device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(torch_device)
    dist.init_process_group("nccl" if torch_device.type == "cuda" else "gloo")
    return Ranks(dist.get_rank(), world, torch_device)


def choose_mask_token(tokenizer: Tokenizer, vocab_size: int) -> int:
    """The tokenizer's own mask token; else the first embedding row past the tokenizer (a
    reserved row: z-lab's choice, 151669 for Qwen3); else a pad token."""
    for name in MASK_TOKEN_NAMES:
        token_id = tokenizer.token_to_id(name)
        if token_id is not None and token_id < vocab_size:
            return token_id
    if tokenizer.vocab_size < vocab_size:
        return tokenizer.vocab_size
    for name in (tokenizer.pad_token, *PAD_TOKEN_NAMES):
        token_id = tokenizer.token_to_id(name) if name else None
        if token_id is not None and token_id < vocab_size:
            return token_id
    raise TrainError("the tokenizer has no mask or pad token and the embedding no spare row; pass --mask-token-id")


def lr_at(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over 5 % of the steps, then cosine down to 10 % of the peak."""
    warmup = max(1, steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def engine_generator(target_path: str, device: torch.device):
    """Responses to prompts from the target itself, through our engine (greedy, batched)."""
    def generate(prompts: list[list[int]], seq_len: int) -> list[list[int]]:
        from blockspec.llm import LLM
        from blockspec.sampling import SamplingParams
        llm = LLM(target_path, device=str(device), max_model_len=seq_len, show_progress=False, threads=None)
        params = [SamplingParams(max_tokens=seq_len - len(p), temperature=0.0) for p in prompts]
        return [result.token_ids for result in llm.generate(prompts, params)]
    return generate


def write_token_jsonl(examples: data.Examples, path: Path) -> None:
    rows = (json.dumps({"token_ids": ids[:n].tolist(), "prompt_len": int(p)})
            for ids, n, p in zip(examples.ids, examples.lengths, examples.prompt_lens))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".tmp").write_text("\n".join(rows) + "\n")
    os.replace(path.with_suffix(".tmp"), path)


def load_examples(source: str | None, tokenizer: Tokenizer, config: TrainConfig, ranks: Ranks, cache: Path) -> data.Examples:
    """None reads the standard library. JSONL prompts are answered once, on rank 0, and kept in
    `cache` (other ranks and a resumed run read the answers from there); text and token data are
    read by every rank."""
    if source is None:
        from blockspec.train.corpus import read_sources, stdlib_files
        return data.pack(data.text_examples(read_sources(stdlib_files()), tokenizer, config.seq_len,
                                            tokenizer.eos_token_id), config.seq_len)
    if Path(source).suffix != ".jsonl":
        return data.read_examples(source, tokenizer, config.seq_len)
    if not cache.exists():
        answered = None
        if ranks.rank == 0:
            called = []

            def generate(prompts: list[list[int]], seq_len: int) -> list[list[int]]:
                called.append(True)
                return engine_generator(config.target, ranks.device)(prompts, seq_len)
            answered = data.read_examples(source, tokenizer, config.seq_len, generate)
            if called:
                write_token_jsonl(answered, cache)
        ranks.barrier()
        if not cache.exists():                    # token ids only: nothing was generated
            return answered or data.read_examples(source, tokenizer, config.seq_len)
    return data.read_examples(str(cache), tokenizer, config.seq_len)


class Trainer:
    """Holds the frozen target, the draft, the optimizer and the data of one run."""

    def __init__(self, config: TrainConfig, ranks: Ranks) -> None:
        from blockspec.loader import load_model, load_tokenizer
        if config.batch_size % ranks.world:
            raise TrainError(f"--batch-size {config.batch_size} (global) does not split over {ranks.world} processes")
        self.config, self.ranks, self.device = config, ranks, ranks.device
        self.out = Path(config.out).expanduser()
        # float32 on CPU: a GGUF target's head must carry the draft's gradient, and its blocks kept
        # quantized (dtype auto on CPU, layers/quant.py) run kernels that have no derivative.
        dtype = "float32" if self.device.type == "cpu" else "auto"
        loaded = load_model(config.target, device=str(self.device), dtype=dtype, show_progress=False)
        self.target_path = str(loaded.path)
        self.target = loaded.model.requires_grad_(False)
        self.tokenizer = load_tokenizer(loaded.path)
        self.vocab_size = int(features.lm_head(self.target).weight.shape[0])
        self.draft_config = self.make_draft_config()
        self.layer_ids = tuple(self.draft_config["dflash_config"]["target_layer_ids"])
        self.mask_token_id = int(self.draft_config["dflash_config"]["mask_token_id"])
        self.train_data, self.eval_data = self.read_data()
        self.draft = checkpoint.build_draft(self.draft_config, self.device, config.seed)
        if config.init_from:
            self.start_from(config.init_from)
        self.optimizer = torch.optim.AdamW(self.draft.parameters(), lr=config.lr, betas=(0.9, 0.95),
                                           weight_decay=0.01)
        self.weights = blockwise.position_weights(config.block_size, self.device)
        self.save_dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.step = 0

    def start_from(self, path: str) -> None:
        """The weights of a saved draft of the same shape, layer ids and mask token (its block size
        may differ: the weights do not depend on it), to train on from there: a run that
        continues an earlier one's draft on a new machine, with a schedule and optimizer of its own.
        A saved draft of fewer layers grows into this run's: its layers come first and each new
        layer starts with zero output projections (o_proj, down_proj), so the grown draft computes
        exactly what the saved one does (the new layers add nothing to the residual stream) and
        its extra depth is learnt from there, not from a random start."""
        from blockspec.loader import load_draft
        config_file = Path(path).expanduser() / "config.json"
        try:
            saved = json.loads(config_file.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise TrainError(f"--init-from {path}: no draft config.json there ({exc})") from None
        keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "dflash_config")
        differ = [k for k in keys if saved.get(k) != self.draft_config.get(k)]
        num_saved, num_layers = int(saved.get("num_hidden_layers", 0)), int(self.draft_config["num_hidden_layers"])
        types = self.draft_config.get("layer_types") or ["full_attention"] * num_layers
        saved_types = saved.get("layer_types") or ["full_attention"] * num_saved
        if not 0 < num_saved <= num_layers or saved_types != types[:num_saved]:
            differ.insert(0, "num_hidden_layers")
        if differ:
            raise TrainError(f"--init-from {path}: that draft has other settings ({', '.join(differ)}) than this run's")
        weights = load_draft(str(config_file.parent), self.target).state_dict()
        missing, unexpected = self.draft.load_state_dict(weights, strict=False)   # copied into the fp32 parameters
        new_layers = tuple(f"layers.{i}." for i in range(num_saved, num_layers))
        misfits = [*unexpected, *(k for k in missing if not k.startswith(new_layers))]
        if misfits:
            raise TrainError(f"--init-from {path}: its weights do not fit this run's draft ({', '.join(misfits[:3])})")
        with torch.no_grad():
            for layer in self.draft.layers[num_saved:]:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()

    def make_draft_config(self) -> dict[str, Any]:
        from blockspec.models.dflash import default_target_layer_ids
        config, target = self.config, self.target
        layer_ids = list(config.target_layer_ids or default_target_layer_ids(target.num_layers, config.num_layers))
        bad = [i for i in layer_ids if not 0 <= i < target.num_layers]
        if bad:
            raise TrainError(f"--target-layer-ids {bad} outside the target's {target.num_layers} layers")
        mask_id = config.mask_token_id
        if mask_id is None:
            mask_id = choose_mask_token(self.tokenizer, self.vocab_size)
        if not 0 <= mask_id < self.vocab_size:
            raise TrainError(f"--mask-token-id {mask_id} is outside the target's vocabulary of {self.vocab_size}")
        return checkpoint.draft_config_dict(target.config, config.num_layers, config.block_size, layer_ids, mask_id)

    def read_data(self) -> tuple[data.Examples, data.Examples]:
        config = self.config
        examples = load_examples(config.data, self.tokenizer, config, self.ranks, self.out / "data.generated.jsonl")
        data.check_vocab(examples, self.vocab_size, f"--data {config.data or 'the standard library'}")
        if config.eval_data:
            held_out = load_examples(config.eval_data, self.tokenizer, config, self.ranks, self.out / "eval.generated.jsonl")
            data.check_vocab(held_out, self.vocab_size, f"--eval-data {config.eval_data}")
            return examples, held_out
        num_held = min(config.eval_prompts, len(examples) // 10)
        if num_held == 0:                     # too little data to hold any out: evaluate on it
            return examples, examples
        return examples.take(range(len(examples) - num_held)), examples.take(range(len(examples) - num_held, len(examples)))

    def run_args(self) -> dict[str, Any]:
        args = asdict(self.config)
        args["target_layer_ids"], args["mask_token_id"] = list(self.layer_ids), self.mask_token_id
        args["num_anchors"] = self.config.anchors_per_seq
        return {k: args[k] for k in RUN_KEYS}

    def batch(self, step: int) -> tuple[data.Examples, torch.Tensor, torch.Tensor, float]:
        """This rank's slice of the global batch, its anchors, and the global loss weight."""
        config, ranks = self.config, self.ranks
        index = data.batch_indices(step, config.batch_size, len(self.train_data), config.seed)
        batch = self.train_data.take(index)
        anchors, valid = blockwise.sample_anchors(batch.lengths, batch.prompt_lens, config.anchors_per_seq,
                                                  data.step_generator(config.seed, step))
        _, label_valid = blockwise.block_labels(batch.ids, batch.lengths, anchors, valid, config.block_size)
        total_weight = float((label_valid * self.weights.cpu()).sum())
        per_rank = config.batch_size // ranks.world
        mine = slice(ranks.rank * per_rank, (ranks.rank + 1) * per_rank)
        return batch.take(range(len(batch))[mine]), anchors[mine], valid[mine], total_weight

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda")

    def block_logits(self, ids: torch.Tensor, anchors: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        """The draft's logits [b, N, bs − 1, V] of the blocks at anchors [b, N] of ids [b, L]
        (on the device), with the draft's autograd graph: slot k predicts token a + k. What the
        engine's draft computes at the same anchors (tests/test_train.py holds the two equal).
        context: the target's features of ids, where the caller has them already."""
        bs, device = self.config.block_size, self.device
        with self.autocast():
            if context is None:
                context = features.target_features(self.target, ids, self.layer_ids)    # [b, L, K·H]
            block_ids = torch.full((*anchors.shape, bs), self.mask_token_id, dtype=torch.long, device=device)
            block_ids[..., 0] = torch.gather(ids, 1, anchors)
            with torch.no_grad():
                embeds = features.embed(self.target, block_ids.flatten(1))             # [b, N·bs, H]
            mask = blockwise.block_sparse_mask(anchors, ids.shape[1], bs)
            hidden = blockwise.draft_hidden(self.draft, embeds, context, blockwise.block_positions(anchors, bs), mask)
            # Flat rows: the slice is not contiguous, and a linear over a strided 4-D input runs as
            # a batched matmul against a broadcast head (~7× slower than one matmul on CPU).
            hidden = hidden.view(*anchors.shape, bs, -1)[:, :, 1:].flatten(0, 2)
            return features.lm_head(self.target)(hidden).view(*anchors.shape, bs - 1, -1)

    def loss_sum(self, batch: data.Examples, anchors: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Σ weight · CE of this rank's blocks (fp32), with the draft's autograd graph."""
        ids, lengths = batch.ids.to(self.device), batch.lengths.to(self.device)
        anchors, valid = anchors.to(self.device), valid.to(self.device)
        context, label_ids, bs = None, ids, self.config.block_size
        if self.config.labels == "target":
            with self.autocast():
                context, label_ids = features.features_and_choices(self.target, ids, self.layer_ids)
        if self.config.labels == "distill":
            with self.autocast():
                context, top_ids, top_probs = features.features_and_distributions(
                    self.target, ids, self.layer_ids, min(DISTILL_TOP, self.vocab_size))
        logits = self.block_logits(ids, anchors, context)
        labels, label_valid = blockwise.block_labels(label_ids, lengths, anchors, valid, bs)
        if self.config.labels == "distill":
            return blockwise.soft_block_loss(logits, blockwise.block_positions_of(top_ids, anchors, bs),
                                             blockwise.block_positions_of(top_probs, anchors, bs),
                                             label_valid * self.weights)
        return blockwise.block_loss(logits, labels, label_valid * self.weights)

    def train_step(self, step: int) -> float:
        """One optimizer step; returns the global mean weighted loss."""
        batch, anchors, valid, total_weight = self.batch(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, self.config.steps, self.config.lr)
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_sum(batch, anchors, valid) / max(total_weight, 1e-9)
        loss.backward()
        reported = loss.detach()
        if self.ranks.world > 1:
            for p in self.draft.parameters():
                dist.all_reduce(p.grad)
            dist.all_reduce(reported)
        torch.nn.utils.clip_grad_norm_(self.draft.parameters(), 1.0)
        self.optimizer.step()
        return float(reported)

    def resume(self) -> None:
        found = checkpoint.latest_checkpoint(self.out)
        if found is None:
            raise TrainError(f"--resume: no checkpoint under {self.out / 'checkpoints'}")
        state = checkpoint.load_state(found, self.device)
        # A key an older checkpoint lacks (a flag added since) had its default then.
        saved = {**{f.name: f.default for f in fields(TrainConfig) if f.name in RUN_KEYS}, **state["run_args"]}
        changed = [k for k, v in self.run_args().items() if saved.get(k) != v]
        if changed:
            raise TrainError(f"--resume: {found} was trained with other settings ({', '.join(changed)}); "
                             "use the same flags or a new --out")
        self.draft.load_state_dict(state["draft"])
        self.optimizer.load_state_dict(state["optimizer"])
        checkpoint.set_rng_states(state["rng"])
        self.step = int(state["step"])

    def save(self) -> None:
        if self.ranks.rank == 0:
            checkpoint.save_checkpoint(self.out, self.step, self.draft, self.optimizer, self.draft_config,
                                       self.run_args(), self.save_dtype)
        self.ranks.barrier()

    def evaluate(self) -> float | None:
        """Mean acceptance length of greedy DFlash decoding of held-out prompts, measured by our
        engine on the draft as saved (rank 0; the others wait)."""
        mean = None
        if self.config.eval_prompts == 0:
            return None
        if self.ranks.rank == 0:
            checkpoint.save_draft(self.draft, self.draft_config, self.out, self.save_dtype)
            max_len = min(self.config.seq_len + self.config.eval_tokens, self.target.config.max_position_embeddings)
            mean = measure_acceptance(self.target_path, str(self.out), self.eval_data, self.config, self.device, max_len)
        self.ranks.barrier()
        return mean


def eval_prompt(ids: torch.Tensor, length: int, prompt_len: int) -> list[int]:
    """A held-out example's prompt: its own prompt, else its first quarter (at most 64 tokens)."""
    cut = prompt_len if prompt_len > 0 else max(1, min(64, length // 4))
    return ids[:cut].tolist()


def measure_acceptance(target: str, draft: str, examples: data.Examples, config: TrainConfig,
                       device: torch.device, max_len: int) -> float:
    from blockspec.llm import LLM
    from blockspec.sampling import SamplingParams
    llm = LLM(target, draft=draft, block_size=config.block_size, device=str(device), show_progress=False, threads=None,
              max_model_len=max_len, speculation="fixed")        # every draft verified: the draft's own τ
    lengths: list[int] = []
    for i in range(min(config.eval_prompts, len(examples))):
        prompt = eval_prompt(examples.ids[i], int(examples.lengths[i]), int(examples.prompt_lens[i]))[: max_len - 2]
        max_tokens = min(config.eval_tokens, max_len - len(prompt))
        result = llm.generate_ids(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        lengths += result.stats.acceptance_lengths
    return sum(lengths) / max(1, len(lengths))


def log_line(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def stop_everywhere(stop: bool, ranks: Ranks) -> bool:
    """Rank 0's decision, on every rank."""
    if ranks.world == 1:
        return stop
    flag = torch.tensor([float(stop)], device=ranks.device)
    dist.broadcast(flag, 0)
    return bool(flag.item())


def train(config: TrainConfig) -> dict[str, Any]:
    """Run (or resume) training; returns the last step's loss and acceptance length."""
    ranks = init_ranks(config.device)
    try:
        return run(Trainer(config, ranks))
    finally:
        if ranks.world > 1:
            dist.destroy_process_group()


def run(trainer: Trainer) -> dict[str, Any]:
    from tqdm import tqdm

    from blockspec.progress import on_terminal
    config, is_main = trainer.config, trainer.ranks.rank == 0
    show_bar = config.show_progress and on_terminal()         # off a terminal: JSON progress lines instead
    trainer.out.mkdir(parents=True, exist_ok=True)
    log = trainer.out / "train_log.jsonl"
    if config.resume:
        trainer.resume()
    elif is_main:
        log.unlink(missing_ok=True)
    summary: dict[str, Any] = {"step": trainer.step, "mask_token_id": trainer.mask_token_id,
                               "target_layer_ids": list(trainer.layer_ids)}
    if trainer.step == 0 and config.eval_every:
        summary["acceptance_length"] = trainer.evaluate()
        if is_main:
            log_line(log, {"step": 0, "acceptance_length": summary["acceptance_length"]})
    tokens_per_step = config.batch_size * config.seq_len
    bar = tqdm(total=config.steps, initial=trainer.step, desc="train-draft", unit="step",
               disable=not (show_bar and is_main), dynamic_ncols=True)
    deadline = time.perf_counter() + (config.max_seconds or math.inf)
    while trainer.step < config.steps:
        started = time.perf_counter()
        loss = trainer.train_step(trainer.step)
        trainer.step += 1
        speed = tokens_per_step / (time.perf_counter() - started)
        summary.update(step=trainer.step, loss=loss)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{speed:,.0f}", accept=summary.get("acceptance_length"))
        record: dict[str, Any] = {"step": trainer.step, "loss": round(loss, 5), "tokens_per_s": round(speed)}
        # Every rank stops at the same step: rank 0's clock decides (a bounded device call).
        out_of_time = stop_everywhere(time.perf_counter() > deadline, trainer.ranks)
        is_last = trainer.step == config.steps or out_of_time
        if config.save_every and (trainer.step % config.save_every == 0 or is_last):
            trainer.save()
        if (config.eval_every and trainer.step % config.eval_every == 0) or is_last:
            summary["acceptance_length"] = record["acceptance_length"] = trainer.evaluate()
        if is_main:
            log_line(log, record)
            if not show_bar and ("acceptance_length" in record or trainer.step % max(1, config.steps // 10) == 0):
                print(json.dumps(record), flush=True)          # logs without a progress bar still show progress
        if out_of_time:
            summary["stopped_by_max_seconds"] = True
            break
    bar.close()
    if is_main:
        checkpoint.save_draft(trainer.draft, trainer.draft_config, trainer.out, trainer.save_dtype)
    return summary
