"""Frozen configuration dataclasses, parsed from Hugging Face config.json dicts."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from blockspec.options import BENCH, GENERATE, SERVE, option


class ConfigError(ValueError):
    """A config.json that we cannot serve: names the field and what to do."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"             # default | llama3 | linear
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0
    # Multimodal RoPE (Qwen3-VL, Qwen3.5): frequency i of the rotary half takes its angle from the
    # temporal, height or width position, interleaved (i mod 3 picks, within each section's length).
    mrope_section: tuple[int, ...] = ()

    @staticmethod
    def from_hf(d: dict[str, Any]) -> "RopeConfig":
        # transformers >= 5 writes `rope_parameters`; older checkpoints `rope_theta` + `rope_scaling`.
        params = dict(d.get("rope_parameters") or {})
        scaling = d.get("rope_scaling") or {}
        params = {**scaling, **params}
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type == "mrope":          # older configs name the multimodal sections as a rope type
            rope_type = "default"
        section = tuple(int(s) for s in params.get("mrope_section") or ())
        if section and not params.get("mrope_interleaved", True):
            raise ConfigError("mrope_interleaved false (Qwen2-VL's sectioned M-RoPE) is not supported")
        if rope_type not in ("default", "llama3", "linear"):
            raise ConfigError(f"rope type {rope_type!r} is not supported (default, llama3, linear are)")
        return RopeConfig(
            theta=float(params.get("rope_theta", d.get("rope_theta", 10000.0))),
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
            partial_rotary_factor=float(params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))),
            mrope_section=section,
        )


@dataclass(frozen=True)
class MoeConfig:
    """Which layers are sparse and how they route. Layer i is sparse when i is not in
    mlp_only_layers and (i + 1) is a multiple of decoder_sparse_step (transformers' rule)."""
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    normalize: bool                            # renormalise the top-k probabilities to sum to 1
    shared_expert_intermediate_size: int = 0   # 0: no shared expert (Qwen3-MoE)
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok {self.num_experts_per_tok} must be in 1..num_experts "
                              f"({self.num_experts})")
        if self.moe_intermediate_size <= 0 or self.decoder_sparse_step <= 0:
            raise ConfigError("moe_intermediate_size and decoder_sparse_step must be positive")

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @staticmethod
    def from_hf(d: dict[str, Any], architecture: str) -> "MoeConfig | None":
        """None for a dense config; a ConfigError for a MoE we would compute wrongly."""
        num_experts = int(d.get("num_experts") or d.get("num_local_experts") or 0)
        if num_experts == 0:
            return None
        family = moe_family(d.get("model_type", ""), architecture)
        check_router(d)
        common = dict(num_experts=num_experts, num_experts_per_tok=int(d["num_experts_per_tok"]),
                      moe_intermediate_size=int(d["moe_intermediate_size"]))
        if family == "qwen3_5_moe":      # every layer sparse, always renormalised (transformers)
            return MoeConfig(**common, normalize=True,
                             shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size", 512)))
        shared = int(d.get("shared_expert_intermediate_size", 512)) if family == "qwen3_next" else 0
        return MoeConfig(**common, normalize=bool(d.get("norm_topk_prob", family == "qwen3_next")),
                         shared_expert_intermediate_size=shared,
                         decoder_sparse_step=int(d.get("decoder_sparse_step") or 1),
                         mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()))


MOE_FAMILIES = ("qwen3_moe", "qwen3_next", "qwen3_5_moe")
# Config keys of routers other than softmax → top-k (DeepSeek-style grouped / sigmoid / scaled),
# with the value that means "the plain router": anything else is refused, never approximated.
PLAIN_ROUTER = {"scoring_func": "softmax", "topk_method": "greedy", "n_group": 1, "topk_group": 1,
                "routed_scaling_factor": 1.0}


def moe_family(model_type: str, architecture: str) -> str:
    for family, arch_prefix in zip(MOE_FAMILIES, ("Qwen3Moe", "Qwen3Next", "Qwen3_5Moe")):
        if model_type.startswith(family) or architecture.startswith(arch_prefix):
            return family
    raise ConfigError(f"num_experts is set for model_type {model_type!r} ({architecture}): mixture-of-experts "
                      f"is supported for {', '.join(MOE_FAMILIES)} only")


def check_router(d: dict[str, Any]) -> None:
    for key, plain in PLAIN_ROUTER.items():
        if d.get(key) not in (None, plain):
            raise ConfigError(f"MoE router with {key}={d[key]!r} is not supported (only softmax top-k routing is)")
    if d.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ConfigError(f"hidden_act {d['hidden_act']!r} is not supported for experts (silu is)")


@dataclass(frozen=True)
class ModelConfig:
    """A dense decoder-only transformer (Qwen3, Qwen2, Llama)."""
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool                  # on q/k/v projections
    attention_out_bias: bool              # on o_proj (Llama's attention_bias; never Qwen2's)
    mlp_bias: bool
    use_qk_norm: bool
    eos_token_ids: tuple[int, ...] = ()
    moe: MoeConfig | None = None          # sparse feed-forward layers, if any
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        has_dense_mlp = self.moe is None or not all(self.moe.is_sparse(i) for i in range(self.num_hidden_layers))
        if has_dense_mlp and self.intermediate_size <= 0:
            raise ConfigError("intermediate_size is missing; the config has dense MLP layers that need it")

    @staticmethod
    def from_hf(d: dict[str, Any], architecture: str) -> "ModelConfig":
        num_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        model_type = d.get("model_type", "")
        return ModelConfig(
            architecture=architecture,
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d.get("intermediate_size") or 0),   # all-MoE configs may omit it
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(d.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(d),
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 has q/k/v biases without saying so in config.json.
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
            attention_out_bias=model_type != "qwen2" and bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            use_qk_norm=(model_type in ("qwen3", "qwen3_moe", "qwen3_vl_text")
                         or architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")),
            eos_token_ids=eos_ids(d.get("eos_token_id")),
            moe=MoeConfig.from_hf(d, architecture),
            raw=d,
        )


def eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


DTYPES = ("auto", "float32", "bfloat16", "float16")
SPECULATION_MODES = ("adaptive", "fixed", "off")      # engine/spec/policy.py
QUANTIZATIONS = ("fp8",)                               # layers/fp8.py
DEFAULT_MAX_MODEL_LEN = 4096             # EngineConfig's own default (built directly, as tests do); the
                                         # options resolve an unset --max-model-len to the model's positions


@dataclass(frozen=True)
class EngineOptions:
    """Every engine option, declared once: the flags of serve / generate / bench (blockspec/options.py
    makes them), the LLM(...) keyword arguments and the engine's half of the server's settings.
    Add an option here, as one field; read it in the engine from EngineConfig (which has them all).
    None means "chosen at load time" (noted in the help)."""
    model: str | None = option(None, "checkpoint directory, Hugging Face hub id, .gguf file, or smollm2 "
                               "(SmolLM2-135M-Instruct, fetched once, with its shipped draft) (none: the shipped "
                               "demo target with its draft, on CPU)", (SERVE, GENERATE))
    draft: str | None = option(None, "DFlash draft checkpoint (directory or hub id); none: plain decoding",
                               (SERVE, GENERATE))
    block_size: int | None = option(None, "DFlash block size, at most the draft's own (none: the draft's)",
                                    (SERVE, GENERATE))
    dtype: str = option("auto", "weights' dtype (auto: bfloat16 on CUDA, float32 on CPU)", (SERVE, GENERATE),
                        choices=DTYPES)
    device: str = option("auto", "auto | cpu | cuda[:N]")
    quantization: str | None = option(None, "fp8: the target's decoder weights quantized to FP8 e4m3 on load "
                                      "(128 x 128 block scales; CUDA of compute capability 8.9 or later). FP8 "
                                      "checkpoints load as FP8 without it; the draft and the KV cache stay bf16",
                                      (SERVE, GENERATE, BENCH), choices=QUANTIZATIONS)
    max_model_len: int | None = option(None, "context limit, prompt + output tokens (none: the model's "
                                       "max_position_embeddings; bench: what its requests need)", (SERVE, GENERATE, BENCH))
    max_num_seqs: int | None = option(None, "sequences decoded together in one batch (none: 256 on CUDA, as "
                                      "vLLM; 32 on CPU)", (SERVE,))
    max_queue: int = option(64, "requests waiting beyond the running batch (more: 503)", (SERVE,))
    threads: int | None = option(1, "torch's CPU threads, when running on CPU. 1 measured fastest for the demo "
                                 "pair on a shared 2-core machine (BENCHMARKS.md); raise it for a larger model on an "
                                 "idle machine with more cores", metavar="N")
    page_size: int = option(16, "tokens per KV-cache page", ())
    num_pages: int | None = option(None, "KV-cache pages (older name of num_gpu_blocks)", ())
    max_prefill_tokens: int = option(2048, "prompt tokens per step, at most (within the token budget)", ())
    max_num_batched_tokens: int = option(2048, "tokens of one step: every decoding sequence's verify rows, then "
                                         "prefill chunks with the rest (a long prompt never stalls decoding)")
    gpu_memory_utilization: float = option(0.9, "fraction of the GPU the engine fills: weights, activations, "
                                           "CUDA graphs, and KV-cache pages in the rest", metavar="FRACTION")
    num_gpu_blocks: int | None = option(None, "KV-cache pages, overriding the size measured from memory "
                                        "(none: measured)")
    kv_cache_memory: int | None = option(None, "bytes of KV cache off CUDA (none: 4 GiB, at most what "
                                         "max_num_seqs full-length sequences use)", metavar="BYTES")
    cuda_graphs: bool = option(True, "capture CUDA graphs for decoding", ())
    speculation: str | None = option(None, "with a draft: adaptive (each step each sequence verifies the drafts "
                                     "that pay off at this load, none: then it does not draft), fixed (every "
                                     "draft of the block), off (plain decoding); default: adaptive, fixed with "
                                     "--tensor-parallel-size > 1", (SERVE, GENERATE),
                                     choices=SPECULATION_MODES)
    prefix_cache: bool = option(True, "reuse the K/V (and a hybrid target's recurrent state) of prompt "
                                "prefixes computed before (--no-prefix-cache: every prompt computed whole)")
    prefix_state_slots: int = option(64, "hybrid targets: recurrent-state snapshots the prefix cache keeps "
                                     "(each one slot of every linear-attention layer's state)")
    tensor_parallel_size: int = option(1, "devices the target is split over (tensor parallel: one worker process "
                                       "per further device; under torchrun, its processes)", metavar="N")
    expert_parallel: bool = option(False, "MoE targets with --tensor-parallel-size: each rank holds 1/N of the "
                                   "experts, whole (expert parallel), rather than 1/N of every expert's rows")

    def __post_init__(self) -> None:
        checks = [(self.max_model_len is None or self.max_model_len >= 2, "--max-model-len must be at least 2"),
                  (self.block_size is None or self.block_size >= 1, "--block-size must be at least 1"),
                  (self.max_num_seqs is None or self.max_num_seqs >= 1, "--max-num-seqs must be at least 1"),
                  (self.max_queue >= 1, "--max-queue must be at least 1"),
                  (self.threads is None or self.threads >= 1, "--threads must be at least 1"),
                  (self.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}"),
                  (self.quantization in (None, *QUANTIZATIONS),
                   f"--quantization must be one of {', '.join(QUANTIZATIONS)} (got {self.quantization!r})"),
                  (self.page_size >= 1, "the page size must be at least 1"),
                  (self.num_pages is None or self.num_pages >= 2, "the KV pool needs at least 2 pages"),
                  (self.max_prefill_tokens >= 1, "the prefill chunk must be at least 1 token"),
                  (0.0 < self.gpu_memory_utilization <= 1.0, "--gpu-memory-utilization must be in (0, 1]"),
                  (self.num_gpu_blocks is None or self.num_gpu_blocks >= 2, "--num-gpu-blocks must be at least 2"),
                  (self.kv_cache_memory is None or self.kv_cache_memory > 0, "--kv-cache-memory must be positive"),
                  (self.max_num_batched_tokens >= (self.block_size or 1),
                   "--max-num-batched-tokens must hold at least one block (--block-size)"),
                  (self.speculation is None or self.speculation in SPECULATION_MODES,
                   f"--speculation must be one of {', '.join(SPECULATION_MODES)} (got {self.speculation!r})"),
                  (self.prefix_state_slots >= 0, "--prefix-state-slots must be at least 0"),
                  (self.tensor_parallel_size >= 1, "--tensor-parallel-size must be at least 1"),
                  (self.tensor_parallel_size > 1 or not self.expert_parallel,
                   "--expert-parallel splits experts over ranks: it needs --tensor-parallel-size > 1"),
                  (self.tensor_parallel_size == 1 or self.quantization is None,
                   "--quantization fp8 runs on one device only (use --tensor-parallel-size 1)"),
                  (self.tensor_parallel_size == 1 or self.speculation != "adaptive",
                   "--speculation adaptive runs on one device only (its widths are rank 0's decision inside "
                   "the step); use fixed with --tensor-parallel-size"),
                  (self.tensor_parallel_size == 1 or ":" not in self.device,
                   "--device cuda:N names one device; with --tensor-parallel-size N the ranks use cuda:0 … "
                   "cuda:N-1 (choose them with CUDA_VISIBLE_DEVICES)")]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)


@dataclass(frozen=True)
class EngineConfig(EngineOptions):
    """The options as the engine runs them: the three chosen at load time filled in (resolve_engine_config),
    and the speculation mode (default_speculation).

    block_size 1 is plain decoding (no draft forward). The KV pool's size: num_gpu_blocks (or
    num_pages, its older name) pages when given; else from memory (engine/memory.py): on CUDA what
    gpu_memory_utilization of the device leaves after weights, one forward at the full token
    budget and the graphs; elsewhere kv_cache_memory bytes. Never more than max_num_seqs
    sequences of max_model_len tokens (plus one block of verify slack each) can use."""
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    block_size: int = 1
    max_num_seqs: int = 32

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculation", default_speculation(self))      # always a mode here
        super().__post_init__()

    @property
    def max_positions_per_seq(self) -> int:
        """A verify may write one block past the context limit before its tokens are cut."""
        return self.max_model_len + self.block_size

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_positions_per_seq // self.page_size)

    @property
    def page_override(self) -> int | None:
        return self.num_gpu_blocks if self.num_gpu_blocks is not None else self.num_pages

    @property
    def worst_case_pages(self) -> int:
        """Pages max_num_seqs sequences of max_model_len can ever hold (+ the padding page)."""
        return self.max_num_seqs * self.pages_per_seq + 1

    @property
    def total_pages(self) -> int:
        """The pool when no memory measurement decides it (an override, else the worst case)."""
        return self.page_override if self.page_override is not None else self.worst_case_pages


def context_overflow(max_tokens: int, prompt_tokens: int, max_model_len: int) -> str | None:
    """Why `max_tokens` output tokens do not fit after the prompt (None when they do): the one
    wording of the server's 400 and `generate`'s error."""
    room = max_model_len - prompt_tokens
    if room < 1 or max_tokens <= room:      # room < 1: the prompt alone is too long (said elsewhere)
        return None
    return (f"{max_tokens} output tokens plus the prompt's {prompt_tokens} exceed the context of {max_model_len} "
            f"tokens; ask for at most {room}")


DEFAULT_MAX_NUM_SEQS = {"cuda": 256, "cpu": 32}     # an unset --max-num-seqs, by the device the target is on


def resolve_engine_config(options: EngineOptions, max_positions: int, draft_block_size: int | None,
                          device_type: str = "cpu") -> EngineConfig:
    """The engine config for the loaded models (the one place that checks options against them):
    block size within the draft's (default: the draft's), the context within the model's positions,
    the batch by the device (default: 256 sequences on CUDA, vLLM's, the KV pool from memory)."""
    if draft_block_size is None and options.block_size is not None and options.block_size > 1:
        raise ConfigError("--block-size needs a draft (--draft); plain decoding has no blocks")
    block_size = options.block_size if options.block_size is not None else (draft_block_size or 1)
    if draft_block_size is not None and block_size > draft_block_size:
        raise ConfigError(f"--block-size {block_size} exceeds the draft's block size {draft_block_size}")
    max_model_len = options.max_model_len
    if max_model_len is not None and max_model_len > max_positions:
        raise ConfigError(f"--max-model-len {max_model_len} exceeds the model's {max_positions} positions")
    if max_model_len is None:              # the model's own context (the pool refuses it only if one cannot fit)
        max_model_len = max_positions
    max_num_seqs = options.max_num_seqs
    if max_num_seqs is None:
        max_num_seqs = DEFAULT_MAX_NUM_SEQS.get(device_type, DEFAULT_MAX_NUM_SEQS["cpu"])
    values = {f.name: getattr(options, f.name) for f in dataclasses.fields(EngineOptions)}
    return EngineConfig(**{**values, "block_size": block_size, "max_model_len": max_model_len,
                           "max_num_seqs": max_num_seqs})


def default_speculation(options: EngineOptions) -> str:
    """--speculation as given; else adaptive, and fixed with tensor parallelism (adaptive runs on
    one device only). Adaptive verifies what pays at the load: round 55 (H100) measured it at
    1.00–1.54 × fixed on Qwen3-8B from 1 to 256 sequences (fixed fell to 0.93 × plain at 256),
    0.97–1.05 × on SmolLM2 at 1 / 16 / 64 requests and 1.01–1.02 × on the hybrid and the MoE at
    one. On CPU it became the default in round 56, once a sequence the plan leaves at k = 0 came
    back to drafting (Speculation.allocation): before, a closed loop at one request on the demo
    pair stopped drafting where the whole block ran 1.2 × plain, and now runs 1.1 × fixed."""
    if options.speculation is not None:
        return options.speculation
    return "fixed" if options.tensor_parallel_size > 1 else "adaptive"
