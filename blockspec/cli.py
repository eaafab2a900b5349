"""`blockspec serve | generate | bench | train-draft`. Bad input: one line on stderr and a non-zero exit."""
from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from typing import TYPE_CHECKING, Any, Sequence

from blockspec.config import EngineOptions, context_overflow
from blockspec.options import BENCH, GENERATE, SERVE, HelpFormatter, add_flags, from_namespace
from blockspec.server.settings import ServerSettings

if TYPE_CHECKING:
    from blockspec.tokenizer import Tokenizer


class UsageError(ValueError):
    """Bad command-line input; printed as one line."""


def subcommand(sub: argparse._SubParsersAction, name: str, help: str, description: str | None = None
               ) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help, description=description or help, formatter_class=HelpFormatter)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blockspec", description="DFlash speculative decoding server",
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = subcommand(sub, "generate", "generate once and print the result",
                     "Generate once and print the result: a chat prints the reply; text continued (--raw, "
                     "--prompt-token-ids, the demo's default prompt) prints the prompt followed by its continuation.")
    add_flags(gen, EngineOptions, GENERATE)
    gen.add_argument("--max-tokens", type=int, default=128, metavar="N", help="output tokens at most")
    gen.add_argument("--temperature", type=float, default=0.0, metavar="X", help="0: greedy")
    gen.add_argument("--top-p", type=float, default=1.0, metavar="X", help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=0, metavar="N", help="0: no top-k cut")
    gen.add_argument("--min-p", type=float, default=0.0, metavar="X", help="0: no min-p cut")
    gen.add_argument("--seed", type=int, default=None, metavar="N", help="sampling seed (none: random)")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON line instead of the text: token_ids, text, finish_reason, "
                          "prompt_token_ids and stats (cycles, acceptance lengths, draft and accepted "
                          "tokens, prefill and decode seconds)")
    gen.add_argument("--enable-thinking", choices=["true", "false"], default=None,
                     help="chat template switch for reasoning models")
    gen.add_argument("--raw", action="store_true",
                     help="feed --prompt as text to continue, without the chat template")
    src = gen.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="a user message, rendered with the chat template unless --raw "
                     "(required with --model; the demo has a code prompt to continue)")
    src.add_argument("--messages", help="a JSON list of chat messages")
    src.add_argument("--prompt-token-ids", help="comma-separated token ids, fed as is")
    serve = subcommand(sub, "serve", "run the OpenAI-compatible HTTP server")
    add_flags(serve, ServerSettings, SERVE)
    bench = subcommand(sub, "bench", "measure decoding speed: plain vs DFlash",
                       "Measure decoding speed, plain vs DFlash, in one process. By default on random weights of a "
                       "real model shape (--shape; a GPU is the point, CPU works with --layers); with --demo on the "
                       "shipped demo pair and held-out code (CPU).")
    add_flags(bench, EngineOptions, BENCH)
    bench.add_argument("--shape", default="qwen3-8b", help="the model shape measured (random weights)")
    bench.add_argument("--out", default=None, help="write the results as JSON here")
    bench.add_argument("--vs", action="append", default=[], choices=["transformers", "zlab", "grouped-moe"],
                       help="peers measured in the same run (grouped-moe: MoE targets' plain step with the "
                            "torch._grouped_mm experts instead of the Triton kernel)")
    bench.add_argument("--concurrency", default="1", help="comma-separated numbers of concurrent requests")
    bench.add_argument("--accept-len", type=float, default=None,
                       help="force this mean acceptance length (random weights accept no drafts)")
    bench.add_argument("--block-size", default="16",
                       help="comma-separated; the first is measured at every concurrency, the others' DFlash "
                            "cycle at the first concurrency")
    bench.add_argument("--no-dflash2", action="store_true", help="skip the DFlash 2 draft")
    bench.add_argument("--breakdown", action="store_true",
                       help="also profile one eager target forward per verify width: ms per kernel class")
    bench.add_argument("--layers", type=int, default=None, help="the shape's first N layers only")
    bench.add_argument("--prompt-len", type=int, default=512, metavar="N", help="prompt tokens per request")
    bench.add_argument("--max-tokens", type=int, default=128, metavar="N", help="output tokens per request")
    bench.add_argument("--multi-turn", default=None, metavar="CxT",
                       help="prefix cache: C conversations of T turns over one shared system prompt, with and "
                            "without the cache (hit rate, time to first token per turn), e.g. 32x6")
    bench.add_argument("--system-prompt-tokens", type=int, default=2048, metavar="N",
                       help="--multi-turn: tokens of the shared system prompt")
    bench.add_argument("--user-tokens", type=int, default=64, metavar="N", help="--multi-turn: tokens per user message")
    bench.add_argument("--burst", type=int, default=None, metavar="N",
                       help="burst mode: N requests of --prompt-len tokens arriving at once; reports their time "
                            "to first token (p50, p99), plain and DFlash (fixed whole blocks with --accept-len; adaptive, "
                            "the default, with --accept-profile; both where both are given)")
    bench.add_argument("--burst-decoding", type=int, default=0, metavar="M",
                       help="with --burst: M requests already decoding when the burst arrives; reports the p99 "
                            "gap between their streamed tokens during it")
    bench.add_argument("--demo", action="store_true", help="the shipped demo pair on held-out code: plain vs DFlash (CPU by default)")
    bench.add_argument("--compare-speculation", action="store_true",
                       help="plain / fixed block / adaptive speculation tok/s at each --concurrency, one run "
                            "(random weights: with --accept-profile or --accept-len; with --demo: the demo "
                            "pair's real confidences)")
    bench.add_argument("--accept-profile", default=None, metavar="latent:MEAN[:KAPPA]",
                       help="random weights: each drafted token at output position j is accepted iff u_j < pi_j, "
                            "pi_j ~ Beta(m*KAPPA, (1-m)*KAPPA) and u_j ~ U(0,1) seeded per request; the draft "
                            "reports pi_j as its confidence; m gives mean acceptance length MEAN for the whole "
                            "block (KAPPA default 1: spread difficulties). See BENCHMARKS.md")
    add_train_args(subcommand(sub, "train-draft", "train a DFlash draft for a target (DFlash recipe)"))
    return parser


def add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="the frozen target: checkpoint directory or hub id "
                   "(none: the shipped demo target)")
    p.add_argument("--out", required=True, help="output directory: the draft, checkpoints/, train_log.jsonl")
    p.add_argument("--data", default=None, help="text file, directory of text files, or JSONL "
                   "(token_ids | messages | prompt records; prompts are answered by the target); "
                   "default: the Python standard library's source")
    p.add_argument("--eval-data", default=None, help="held-out data (same formats); default: the tail of --data")
    p.add_argument("--num-layers", type=int, default=1, metavar="N", help="the draft's decoder layers")
    p.add_argument("--block-size", type=int, default=16, metavar="N", help="the draft's block size")
    p.add_argument("--target-layer-ids", default=None, help="comma-separated target layers (default: z-lab's rule)")
    p.add_argument("--mask-token-id", type=int, default=None, metavar="ID",
                   help="(none: the tokenizer's mask token, else the first row past the tokenizer, else pad)")
    p.add_argument("--steps", type=int, default=1000, metavar="N", help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step, over all processes")
    p.add_argument("--lr", type=float, default=6e-4, metavar="X", help="peak learning rate")
    p.add_argument("--seq-len", type=int, default=512, metavar="N", help="tokens per training sequence")
    p.add_argument("--num-anchors", type=int, default=None, help="anchors per sequence (default seq_len / block size)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (under torchrun: one GPU per process)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--eval-every", type=int, default=200, help="steps between acceptance evaluations (0: at the end)")
    p.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts per evaluation (0: none)")
    p.add_argument("--eval-tokens", type=int, default=128, metavar="N", help="tokens decoded per held-out prompt")
    p.add_argument("--save-every", type=int, default=500, metavar="N",
                   help="steps between resumable checkpoints (0: none)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="data order, anchors and initial weights")
    p.add_argument("--max-seconds", type=float, default=None, metavar="S",
                   help="stop after S seconds of training, saving a checkpoint and the draft (a bounded run; "
                   "--resume continues it)")
    p.add_argument("--labels", default="tokens", choices=("tokens", "target", "distill"),
                   help="what each draft slot learns: the data's next tokens, the target's greedy choice "
                   "at each position of the data (for data sampled at a temperature), or the target's "
                   "distribution there (its 32 likeliest tokens: distillation)")
    p.add_argument("--init-from", default=None, metavar="DIR",
                   help="start from this saved draft's weights (same shape, layer ids and mask token; "
                   "a draft of fewer layers grows into --num-layers, its function unchanged; "
                   "a new schedule and optimizer)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def parse_token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise UsageError(f"--prompt-token-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise UsageError("--prompt-token-ids is empty")
    return ids


def parse_messages(text: str) -> list[dict[str, Any]]:
    try:
        messages = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--messages is not valid JSON: {exc}") from None
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise UsageError("--messages must be a non-empty JSON list of message objects")
    for index, message in enumerate(messages):
        check_message(index, message)
    return messages


def check_message(index: int, message: dict[str, Any]) -> None:
    """The server's validation of one chat message (server/protocol.py), as a one-line error."""
    import pydantic
    from blockspec.server.errors import validation_error_message
    from blockspec.server.protocol import ChatMessage
    try:
        ChatMessage.model_validate(message)
    except pydantic.ValidationError as exc:
        raise UsageError(f"--messages, message {index}: {validation_error_message(exc)[0]}") from None


def check_device(device: str) -> None:
    if device == "auto":
        return
    from blockspec.loader import supported_device
    if supported_device(device) is None:    # meta, mps, …: torch's devices, not ours (the load would pass, the step fail)
        raise UsageError(f"--device {device!r} is not a device: use auto, cpu, cuda or cuda:N")


def use_demo_without_model(args: argparse.Namespace) -> None:
    """No --model: the demo target with its DFlash draft, on CPU unless --device says otherwise.
    A named model (--model smollm2) gets the draft shipped for it unless --draft says otherwise,
    on the devices where that draft pays (named.draft_attached_on); elsewhere it says so in a line."""
    if args.model is not None:
        from blockspec.named import default_draft, draft_attached_on
        shipped = default_draft(args.model)
        if args.draft is None and shipped is not None:
            from blockspec.loader import resolve_device
            device_type = resolve_device(args.device).type
            if draft_attached_on(args.model, device_type):
                args.draft = str(shipped)
            else:
                print(f"blockspec: --model {args.model} decodes without its DFlash draft on {device_type}, where the "
                      f"draft costs more than it saves; --draft {shipped} attaches it", file=sys.stderr)
        return
    from blockspec import demo
    target, draft = demo.require_built()
    args.model, args.draft = str(target), args.draft or str(draft)
    args.device = "cpu" if args.device == "auto" else args.device
    if getattr(args, "served_model_name", "") is None:
        args.served_model_name = "blockspec-demo"
    if getattr(args, "prompt", "") is None and args.messages is None and args.prompt_token_ids is None:
        args.prompt, args.raw = demo.DEFAULT_PROMPT, True     # code to continue, without the chat template


def check_model_paths(args: argparse.Namespace) -> None:
    """A bad --model or --draft is the first thing said (before a missing prompt, say)."""
    from blockspec.loader import resolve_model_path
    for path in (args.model, args.draft):
        if path is not None:
            resolve_model_path(path)


def check_generate_args(args: argparse.Namespace) -> None:
    if args.model is not None and args.prompt is None and args.messages is None and args.prompt_token_ids is None:
        raise UsageError("one of --prompt, --messages or --prompt-token-ids is required with --model")
    if args.raw and args.prompt is None:
        raise UsageError("--raw applies to --prompt (token ids are always raw; --messages are a chat)")
    if args.messages is not None:
        parse_messages(args.messages)       # before loading: the server's checks, the same answer
    if args.max_tokens < 1:
        raise UsageError("--max-tokens must be at least 1")
    if not 0 <= args.temperature <= 2:
        raise UsageError("--temperature must be in [0, 2]")
    if not 0 < args.top_p <= 1:
        raise UsageError("--top-p must be in (0, 1]")


def prompt_ids_from_args(args: argparse.Namespace, tokenizer: Tokenizer) -> list[int]:
    if args.raw:
        return tokenizer.encode(args.prompt)
    if args.prompt_token_ids is not None:
        ids = parse_token_ids(args.prompt_token_ids)
        bad = [i for i in ids if not 0 <= i < tokenizer.vocab_size]
        if bad:
            raise UsageError(f"--prompt-token-ids: {bad[0]} is outside the vocabulary of {tokenizer.vocab_size}")
        return ids
    messages = parse_messages(args.messages) if args.messages is not None else [{"role": "user", "content": args.prompt}]
    kwargs = {} if args.enable_thinking is None else {"enable_thinking": args.enable_thinking == "true"}
    return tokenizer.encode_chat(messages, add_generation_prompt=True, **kwargs)


def run_generate(args: argparse.Namespace) -> int:
    check_model_paths(args)
    check_generate_args(args)
    use_demo_without_model(args)
    check_engine_args(args)
    from blockspec.llm import LLM
    from blockspec.sampling import SamplingParams
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.seed)   # bad values fail before loading
    llm = LLM(from_namespace(EngineOptions, args, GENERATE))
    prompt_ids = prompt_ids_from_args(args, llm.tokenizer)
    overflow = context_overflow(args.max_tokens, len(prompt_ids), llm.max_model_len)
    if overflow is not None:                   # the server's 400, not a silent cap
        raise UsageError(f"--max-tokens: {overflow}")
    result = llm.generate_ids(prompt_ids, params, request_id=f"gen-{uuid.uuid4().hex[:8]}")
    if args.json:
        print(json.dumps(result.as_json(), ensure_ascii=False))
    else:
        print(printed_text(args, llm.tokenizer, prompt_ids, result.text))
    return 0


def printed_text(args: argparse.Namespace, tokenizer: Tokenizer, prompt_ids: list[int], output: str) -> str:
    """Text continued (--raw, token ids, the demo) prints as prompt + continuation, so it reads
    as one text; a chat prints the assistant's reply (its prompt is the template's markup)."""
    if args.raw:
        return args.prompt + output
    if args.prompt_token_ids is not None:
        return tokenizer.decode(prompt_ids, skip_special_tokens=True) + output
    return output


def check_engine_args(args: argparse.Namespace) -> None:
    """Engine limits are validated by EngineOptions (the one place), before anything loads."""
    check_device(args.device)
    if args.block_size is not None and args.draft is None and args.model is not None:
        raise UsageError("--block-size is the DFlash block size and needs --draft; add --draft or drop --block-size")
    from_namespace(EngineOptions, args, args.command)


def check_address(host: str, port: int) -> None:
    """Bind --host:--port once (as uvicorn will) so a taken port or a bad host fails before loading."""
    import socket
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except (OSError, UnicodeError) as exc:
        raise UsageError(f"cannot listen on --host {host} --port {port} ({exc}): "
                         "choose a free port, or a host address of this machine") from None


def run_serve(args: argparse.Namespace) -> int:
    check_engine_args(args)
    from_namespace(ServerSettings, args, SERVE)      # the server's own flags, checked before loading
    check_address(args.host, args.port)             # a taken port fails now, not after a long load
    use_demo_without_model(args)
    from blockspec.server.app import serve
    return serve(from_namespace(ServerSettings, args, SERVE))


def run_bench(args: argparse.Namespace) -> int:
    from blockspec.llm import apply_threads
    apply_threads(from_namespace(EngineOptions, args, BENCH).threads)
    other_modes = [flag for flag in ("demo", "burst", "multi_turn") if getattr(args, flag, None)]
    if args.quantization and other_modes:
        raise ValueError(f"--quantization measures the default mode and --compare-speculation only, not "
                         f"--{other_modes[0].replace('_', '-')}")
    if args.demo:
        from blockspec.demo.measure import main as measure_demo, main_compare
        concurrency = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
        if args.compare_speculation:
            return main_compare(args.device, args.out, concurrency)
        return measure_demo(args.device, args.out, concurrency)
    from blockspec.bench import main as bench_main
    return bench_main(args)


def run_train_draft(args: argparse.Namespace) -> int:
    from blockspec.train.loop import TrainConfig, train
    if args.target is None:
        from blockspec import demo
        args.target = str(demo.require_built()[0])
    try:
        layer_ids = tuple(int(i) for i in args.target_layer_ids.split(",")) if args.target_layer_ids else None
    except ValueError:
        raise UsageError(f"--target-layer-ids must be comma-separated integers, got {args.target_layer_ids!r}") from None
    config = TrainConfig(
        target=args.target, out=args.out, data=args.data, eval_data=args.eval_data,
        num_layers=args.num_layers, block_size=args.block_size, target_layer_ids=layer_ids,
        mask_token_id=args.mask_token_id, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
        seq_len=args.seq_len, num_anchors=args.num_anchors, device=args.device, resume=args.resume,
        eval_every=args.eval_every, eval_prompts=args.eval_prompts, eval_tokens=args.eval_tokens,
        save_every=args.save_every, seed=args.seed, show_progress=not args.quiet, max_seconds=args.max_seconds,
        labels=args.labels, init_from=args.init_from)
    summary = train(config)
    if os.environ.get("RANK", "0") == "0":                  # under torchrun, one summary line
        print(json.dumps(summary))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "model", None):
        # Before any rank or command builds a kernel: every torchrun rank, generate, serve and bench
        # alike run the attention a named model asks for.
        from blockspec.named import use_batch_invariance
        use_batch_invariance(args.model)
    if getattr(args, "tensor_parallel_size", 1) > 1 and os.environ.get("RANK", "0") != "0":
        from blockspec.distributed.launch import torchrun_worker      # torchrun's ranks above 0 serve rank 0
        return torchrun_worker(args.device)
    from blockspec.loader import LoadError
    try:
        runner = {"generate": run_generate, "serve": run_serve, "bench": run_bench,
                  "train-draft": run_train_draft}[args.command]
        return runner(args)
    except (UsageError, LoadError, FileNotFoundError, ValueError) as exc:
        print(f"blockspec {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
