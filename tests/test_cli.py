"""`blockspec generate`: the documented JSON line, and one-line errors with a non-zero exit."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


def blockspec(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "blockspec.cli", *args], capture_output=True, text=True, timeout=300)


def test_generate_json_contract(qwen3_dir, qwen3_draft_dir):
    plain = blockspec("generate", "--model", str(qwen3_dir), "--prompt-token-ids", "9707,11,1879",
                      "--max-tokens", "9", "--json")
    assert plain.returncode == 0, plain.stderr
    spec = blockspec("generate", "--model", str(qwen3_dir), "--draft", str(qwen3_draft_dir), "--block-size", "4",
                     "--prompt-token-ids", "9707,11,1879", "--max-tokens", "9", "--json")
    assert spec.returncode == 0, spec.stderr
    line = spec.stdout.strip().splitlines()
    assert len(line) == 1
    out = json.loads(line[0])
    assert set(out) == {"token_ids", "text", "finish_reason", "prompt_token_ids", "stats"}
    assert {"cycles", "acceptance_lengths", "draft_tokens", "accepted_tokens", "prefill_s", "decode_s"} <= set(out["stats"])
    assert out["prompt_token_ids"] == [9707, 11, 1879]
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 9
    assert out["token_ids"] == json.loads(plain.stdout)["token_ids"]
    assert sum(out["stats"]["acceptance_lengths"]) == 8 == len(out["token_ids"]) - 1
    assert len(out["stats"]["acceptance_lengths"]) == out["stats"]["cycles"]


def generate_in_process(capsys, *args: str) -> str:
    """`blockspec generate …` through cli.main (no interpreter start): its stdout."""
    from blockspec.cli import main
    code = main(["generate", *args])
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


def test_generate_renders_the_chat_template(qwen3_dir, capsys):
    out = generate_in_process(capsys, "--model", str(qwen3_dir), "--prompt", "Hi", "--max-tokens", "2", "--json")
    prompt = json.loads(out)["prompt_token_ids"]
    assert prompt[:3] == [151644, 872, 198] and prompt[-3:] == [151644, 77091, 198]  # <|im_start|>user\n … assistant\n
    messages = json.dumps([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    out2 = generate_in_process(capsys, "--model", str(qwen3_dir), "--messages", messages, "--max-tokens", "2", "--json")
    assert len(json.loads(out2)["prompt_token_ids"]) > len(prompt)


def test_generate_raw_continues_the_text_and_prints_it_whole(qwen3_dir, capsys):
    """--raw: the prompt's own tokens (no chat template), printed with its continuation."""
    from blockspec.tokenizer import Tokenizer
    text = "def add(a, b):"
    result = json.loads(generate_in_process(capsys, "--model", str(qwen3_dir), "--prompt", text, "--raw",
                                            "--max-tokens", "4", "--json"))
    assert result["prompt_token_ids"] == Tokenizer.from_dir(qwen3_dir).encode(text)
    printed = generate_in_process(capsys, "--model", str(qwen3_dir), "--prompt", text, "--raw", "--max-tokens", "4")
    assert printed == text + result["text"] + "\n"


@pytest.mark.parametrize("args, message", [
    (["--model", "/nonexistent/dir", "--prompt", "x"], "not a directory"),
    (["--model", "/nonexistent/dir"], "not a directory"),              # the path before the missing prompt
    (["--model", "{qwen3}", "--prompt", "x", "--max-tokens", "100000000"],
     "--max-tokens: 100000000 output tokens plus the prompt's"),     # the server's 400, not a silent cap
    (["--model", "{qwen3}", "--prompt-token-ids", "1,2", "--raw"], "--raw applies to --prompt"),
    (["--model", "{qwen3}", "--draft", "/nonexistent/draft", "--prompt", "x"], "not a directory"),
    (["--model", "{qwen3}", "--prompt-token-ids", "1,a"], "comma-separated integers"),
    (["--model", "{qwen3}", "--prompt-token-ids", "99999999"], "outside the vocabulary"),
    (["--model", "{qwen3}", "--messages", "[not json"], "not valid JSON"),
    (["--model", "{qwen3}", "--messages", "[]"], "non-empty JSON list"),
    (["--model", "{qwen3}", "--messages", '[{{"role": "user"}}]'], "needs content"),
    (["--model", "{qwen3}", "--messages", '[{{"role": "wizard", "content": "x"}}]'], "message 0: Invalid 'role'"),
    (["--model", "{qwen3}", "--messages", '[{{"role": "user", "content": 5}}]'], "content must be a string"),
    (["--model", "{qwen3}", "--prompt", "x", "--seed", "99999999999999999999999"], "seed must be in"),
    (["--model", "{qwen3}", "--prompt", "x", "--device", "bogus"], "--device 'bogus'"),
    (["--model", "{qwen3}", "--prompt", "x", "--block-size", "4"], "--block-size is the DFlash block size"),
    (["--model", "{qwen3}", "--prompt", "x", "--max-tokens", "0"], "--max-tokens"),
    (["--model", "{qwen3}", "--prompt", "x", "--temperature", "-1"], "--temperature"),
    (["--model", "{qwen3}", "--prompt", "x", "--draft", "{draft}", "--block-size", "64"], "exceeds the draft"),
])
def test_bad_input_is_one_line_and_nonzero(qwen3_dir, qwen3_draft_dir, args, message, capsys):
    """In-process (cli.main), so the many cases cost no interpreter start each; an exception
    main did not turn into its one line would fail the test by escaping it."""
    from blockspec.cli import main
    args = [a.format(qwen3=qwen3_dir, draft=qwen3_draft_dir) for a in args]
    code = main(["generate", *args])
    err = capsys.readouterr().err
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in err


def test_unknown_dtype_is_rejected_by_the_parser(qwen3_dir):
    out = blockspec("generate", "--model", str(qwen3_dir), "--prompt", "x", "--dtype", "int3")
    assert out.returncode == 2 and "invalid choice" in out.stderr


@pytest.mark.parametrize("flag, value, message", [("--max-queue", "0", "--max-queue"), ("--port", "70000", "--port"),
                                                   ("--device", "bogus", "--device 'bogus'"),
                                                   ("--shutdown-timeout", "-1", "--shutdown-timeout")])
def test_serve_rejects_bad_flags_before_loading(qwen3_dir, flag, value, message):
    out = blockspec("serve", "--model", str(qwen3_dir), flag, value)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


def test_hub_id_resolves_through_the_local_hub_cache(qwen3_dir, tmp_path):
    """A hub id is looked up in huggingface_hub's cache (offline here); a missing one is one line."""
    import os
    import shutil
    repo = tmp_path / "hub" / "models--tiny-org--tiny-qwen3"
    shutil.copytree(qwen3_dir, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    args = ["generate", "--prompt-token-ids", "9707,11", "--max-tokens", "3", "--json"]
    by_id = subprocess.run([sys.executable, "-m", "blockspec.cli", *args, "--model", "tiny-org/tiny-qwen3"],
                           capture_output=True, text=True, timeout=300, env=env)
    by_dir = blockspec(*args, "--model", str(qwen3_dir))
    assert by_id.returncode == 0, by_id.stderr
    assert json.loads(by_id.stdout)["token_ids"] == json.loads(by_dir.stdout)["token_ids"]
    missing = subprocess.run([sys.executable, "-m", "blockspec.cli", *args, "--model", "tiny-org/absent"],
                             capture_output=True, text=True, timeout=300, env=env)
    assert missing.returncode == 2
    lines = missing.stderr.strip().splitlines()
    assert len(lines) == 1 and "tiny-org/absent" in lines[0] and "download" in lines[0]


def test_serve_fails_on_a_taken_port_or_bad_host_before_loading(qwen3_dir):
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for host, port_arg in (("127.0.0.1", port), ("999.1.1.1", "8000")):
            out = blockspec("serve", "--model", str(qwen3_dir), "--host", host, "--port", port_arg)
            assert out.returncode == 2, out.stderr
            lines = out.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("blockspec serve: error: cannot listen on")


@pytest.mark.parametrize("args, message", [
    (["--model", "/nonexistent/dir"], "not a directory"),
    (["--model", "{empty}"], "config.json"),
    (["--model", "{qwen3}", "--device", "cuda:99"], "cuda"),
    (["--model", "{qwen3}", "--port", "{taken}"], "cannot listen on"),
])
def test_serve_startup_failure_is_one_line_and_nothing_about_serving(qwen3_dir, tmp_path, args, message):
    """Everything is loaded and checked before the port is bound: a failure is one line on
    stderr, exit 2, no traceback, and nothing announced (no uvicorn line, no summary)."""
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        fill = {"qwen3": qwen3_dir, "empty": tmp_path, "taken": taken.getsockname()[1]}
        out = blockspec("serve", *[a.format(**fill) for a in args])
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("blockspec serve: error: ") and message in lines[0], out.stderr
    assert out.stdout == "" and "Traceback" not in out.stderr


@pytest.mark.parametrize("args, message", [
    (["--block-size", "8,x"], "--block-size must be a comma-separated list of integers"),
    (["--block-size", "1"], "--block-size must be a comma-separated list of integers"),
    (["--layers", "0"], "--layers must be at least 1"),
    (["--shape", "nope"], "unknown --shape 'nope'"),
    (["--multi-turn", "4by3"], "--multi-turn takes CONVERSATIONSxTURNS"),
    (["--accept-len", "0"], "--accept-len must be in [1, 16]"),
    (["--accept-len", "17"], "--accept-len must be in [1, 16]"),
    (["--accept-len", "9", "--block-size", "8,4"], "--accept-len must be in [1, 8]"),
    (["--accept-len", "99", "--multi-turn", "1x2"], "--accept-len must be in [1, 16]"),
])
def test_bench_bad_input_is_one_line_and_nonzero(args, message, capsys):
    from blockspec.cli import main
    code = main(["bench", "--device", "cpu", *args])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in err


def test_bench_takes_an_acceptance_length_from_one_to_the_whole_block():
    """--accept-len's bounds are themselves allowed: 1 (every draft rejected) and the largest
    --block-size (every draft accepted)."""
    from blockspec.bench import check_accept_len
    for accept_len, blocks in ((1.0, "16"), (16.0, "16"), (8.0, "4,8"), (None, "x")):
        check_accept_len(accept_len, blocks)


def test_bench_moe_figures_on_cpu(tmp_path):
    """A MoE shape's extra figures: the kernel in use, the other block size's cycle, the grouped
    experts' plain step in the same run, the first N layers only."""
    out = blockspec("bench", "--shape", "tiny-moe", "--device", "cpu", "--layers", "2", "--block-size", "3,2",
                    "--prompt-len", "8", "--max-tokens", "3", "--no-dflash2", "--vs", "grouped-moe",
                    "--out", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["num_hidden_layers"] == 2 and result["block_size"] == 3
    assert result["moe_kernel"] == "blockspec.layers.moe.reference_experts"
    c1 = result["c1"]
    assert c1["dflash_b2_ms_per_cycle"] > 0 and c1["grouped_moe_plain_ms_per_step"] > 0
    assert c1["grouped_moe_step_over_ours"] == c1["grouped_moe_plain_ms_per_step"] / c1["plain_ms_per_step"]
    assert "draft2_weight_GB" not in result


def test_bench_breakdown_on_cpu(tmp_path):
    """--breakdown: one profiled eager forward per verify width, its time split by kernel class
    (on CPU the classes of top-level ops: the linear layers are most of a forward)."""
    out = blockspec("bench", "--shape", "tiny", "--device", "cpu", "--layers", "2", "--block-size", "4",
                    "--prompt-len", "8", "--max-tokens", "2", "--no-dflash2", "--breakdown",
                    "--out", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "r.json").read_text())
    for width in (1, 4):
        figures = result[f"breakdown_w{width}"]
        assert figures["ms_by_class"]["gemm"] > 0 and figures["kernels_per_layer"] > 0
        assert abs(sum(figures["ms_by_class"].values()) - figures["ms_total"]) < 1e-2


@pytest.mark.parametrize("name, label", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("nvjet_tst_128x64_64x4_1x2_h_bz_coopA_NNT", "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float>", "gemm"),
    ("_paged_attention_kernel", "attention"),
    ("_merge_splits_kernel", "attention"),
    ("_expert_gemm_kernel", "moe"),
    ("_align_kernel", "moe"),
    ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "recurrent"),
    ("_add_rms_norm_kernel", "norm_rope_act"),
    ("_qk_norm_rope_kernel", "norm_rope_act"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<float>", "copy_index"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::AUnaryFunctor>", "other_elementwise"),
])
def test_kernel_classes(name, label):
    from blockspec.bench import kernel_class
    assert kernel_class(name) == label


def test_a_failing_bench_request_stops_the_run(qwen3_dir):
    """A request the engine ends with an error never gets tokens: the bench raises at once
    (it used to wait for those tokens forever)."""
    from blockspec.bench import EngineFailed, run_batch
    from blockspec.loader import load_model
    from helpers import make_engine

    def fail(phase, seqs):
        if phase == "prefill":
            raise RuntimeError("injected")

    engine = make_engine(load_model(str(qwen3_dir), device="cpu", dtype="float32").model,
                         max_model_len=64, max_num_seqs=2, max_queue=2)
    engine.fault_hook = fail
    with pytest.raises(EngineFailed, match="injected"):
        run_batch(engine, 2, 8, 4)



def test_a_bench_whose_requests_end_at_their_first_token_says_why(qwen3_dir):
    """Prompts that fill the context end with their first token (finish reason length): the bench
    stops with what did not fit, not with 0 tok/s and a division by zero (the H100's bf16 MoE,
    round 63: a 128-token pool)."""
    from blockspec.bench import EngineFailed, run_batch
    from blockspec.loader import load_model
    from helpers import make_engine

    engine = make_engine(load_model(str(qwen3_dir), device="cpu", dtype="float32").model,
                         max_model_len=32, max_num_seqs=2, max_queue=2)
    with pytest.raises(EngineFailed, match=r"decoded nothing after their prefill \(length after 1 of 8 tokens\): "
                                           r"a 31-token prompt and 8 new tokens do not fit this engine's 32-token"):
        run_batch(engine, 2, 31, 8)
    with pytest.raises(EngineFailed, match=r"\(length after 1 of 1 tokens\): a decode window needs --max-tokens of 2"):
        run_batch(engine, 2, 16, 1)                                  # ended by max_tokens, not by the context
    assert run_batch(engine, 2, 16, 8)["tok_s"] > 0                # the same engine, prompts that fit


def test_the_closed_loop_bench_keeps_its_load_and_ends_unmeasured(qwen3_dir):
    """run_batch(rounds=3): every request that ends is replaced until 3 × concurrency were sent,
    never more than `concurrency` run at once, and all of them finish (the unmeasured drain)."""
    from blockspec.bench import run_batch
    from blockspec.loader import load_model
    from helpers import make_engine

    engine = make_engine(load_model(str(qwen3_dir), device="cpu", dtype="float32").model,
                         max_model_len=64, max_num_seqs=4, max_queue=8)
    running, submitted = [], []
    submit, step = engine.submit, engine.step

    def counted_submit(request, on_event):
        submitted.append(request)
        submit(request, on_event)

    def counted_step():
        step()
        running.append(sum(1 for r in submitted if not r.is_finished))
    engine.submit, engine.step = counted_submit, counted_step
    result = run_batch(engine, 2, 8, 5, rounds=3)
    assert len(submitted) == 6 and all(r.is_finished for r in submitted)
    assert max(running) <= 2 and result["tok_s"] > 0
    assert [len(r.output_ids) for r in submitted] == [5] * 6


def test_bench_multi_turn_on_cpu(tmp_path):
    """--multi-turn: every reusable prompt token of the later turns comes from the prefix cache,
    none with --no-prefix-cache, in one run; a hybrid shape reports its snapshot copy."""
    out = blockspec("bench", "--shape", "tiny-moe", "--device", "cpu", "--layers", "2", "--block-size", "4",
                    "--multi-turn", "2x2", "--system-prompt-tokens", "40", "--user-tokens", "5",
                    "--max-tokens", "6", "--accept-len", "2", "--out", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "r.json").read_text())
    on, off = result["prefix_cache"], result["no_prefix_cache"]
    assert on["hit_rate_of_reusable"] == 1.0 and off["hit_rate_of_reusable"] == 0.0
    second = on["per_turn"][1]
    assert second["cached_tokens"] == second["reusable_tokens"] == 48     # 45 + 6 fed, 51 → 3 full pages
    assert result["no_reuse_tok_s"]["ratio"] > 0 and result["snapshot_copy_ms"]["bytes"] > 0
