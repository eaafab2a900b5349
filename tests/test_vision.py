"""Images in (issue 35): Qwen3-VL, Qwen3.5 and Qwen3.5-MoE with their vision towers, against
transformers on tiny random checkpoints it wrote itself (tests/vision_fixtures.py): the image
processor (exactly), the tower's tokens and DeepStack features (fp32 tolerance), greedy output with
one and with two images of different sizes (token for token, from its processor's inputs), DFlash,
chunked prefill through images and batching (== plain alone), and the prefix cache keyed by image
content; image sequences stepping through the graph dispatcher's padded path."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from blockspec.engine.graphs import EAGER, FULL, PIECEWISE
from blockspec.engine.model_runner import Entry
from blockspec.engine.multimodal import rope_columns, rope_offset
from blockspec.llm import LLM
from blockspec.multimodal import ImageError, ImageProcessorConfig, MediaPolicy, load_image, process_image
from blockspec.sampling import SamplingParams
from helpers import padded
from vision_fixtures import (KINDS, data_url, hf_processor, hf_vl_model, random_image, record_forwards,
                             write_vl_checkpoint, write_vl_draft)

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
IMAGES = {"wide": random_image(37, 53, seed=1), "tall": random_image(70, 30, seed=2, mode="RGBA")}


def image_part(name: str) -> dict:
    return {"type": "image_url", "image_url": {"url": name}}


PROMPTS = {
    "one": ([{"role": "user", "content": [image_part("wide"), {"type": "text", "text": "Describe the picture."}]}],
            ["wide"]),
    "two": ([{"role": "user", "content": [{"type": "text", "text": "Compare"}, image_part("tall"),
                                          {"type": "text", "text": "with"}, image_part("wide")]}],
            ["tall", "wide"]),
}


SMALL_POOL = dict(max_model_len=1024, kv_cache_memory=32 << 20)


@pytest.fixture(scope="module", autouse=True)
def one_tokenizer_load():
    """Every checkpoint here carries the same tokenizer files: parse them once for the module's
    nine engines (about 4 s each on a busy 2-core machine), not once per LLM."""
    import hashlib
    from blockspec import llm as llm_module
    loaded: dict[bytes, object] = {}
    original = llm_module.load_tokenizer

    def load_tokenizer(path):
        key = hashlib.sha256(b"".join((path / name).read_bytes()
                                      for name in ("tokenizer.json", "tokenizer_config.json"))).digest()
        if key not in loaded:
            loaded[key] = original(path)
        return loaded[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llm_module, "load_tokenizer", load_tokenizer)
        yield


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """kind → (checkpoint directory, the transformers model it was saved from)."""
    root = tmp_path_factory.mktemp("vision")
    return {kind: write_vl_checkpoint(root / kind, kind) for kind in KINDS}


@pytest.fixture(scope="module")
def checkpoints(built) -> dict:
    return {kind: path for kind, (path, _) in built.items()}


@pytest.fixture(scope="module")
def plain(checkpoints) -> dict[str, LLM]:
    return {kind: LLM(str(path), show_progress=False, **SMALL_POOL) for kind, path in checkpoints.items()}


@pytest.fixture(scope="module")
def references(built) -> dict:
    """kind → (transformers model, its processor)."""
    return {kind: (model, hf_processor(path)) for kind, (path, model) in built.items()}


def our_request(llm: LLM, messages: list[dict], names: list[str], request_id: str = "r",
                params: SamplingParams = GREEDY):
    """The request of messages with images `names` (none: a text request, as the server makes it)."""
    ids = llm.tokenizer.encode_chat(messages)
    if not names:
        return llm.make_request(request_id, ids, params)
    images = [process_image(IMAGES[name], llm.image_processor) for name in names]
    ids, prompt = llm.image_prompt(ids, images)
    return llm.make_request(request_id, ids, params, multimodal=prompt)


def test_processor_equals_transformers(checkpoints):
    """Resize into the pixel budget (down and up), RGBA over white, normalise, patch order: equal bits."""
    processor = hf_processor(checkpoints["qwen3_vl"]).image_processor
    config = ImageProcessorConfig.from_dir(checkpoints["qwen3_vl"])
    for image in [*IMAGES.values(), random_image(200, 120, seed=3), random_image(5, 9, seed=4)]:
        ref = processor(images=[image], return_tensors="pt")
        ours = process_image(image, config)
        assert ours.grid == tuple(ref["image_grid_thw"][0].tolist())
        assert torch.equal(ours.pixel_values, ref["pixel_values"])


@pytest.mark.parametrize("kind", KINDS)
def test_vision_features_equal_transformers(kind, plain, references):
    model, processor = references[kind]
    config = plain[kind].image_processor
    images = [process_image(image, config) for image in IMAGES.values()]
    ref_inputs = processor.image_processor(images=list(IMAGES.values()), return_tensors="pt")
    with torch.no_grad():
        ref = model.model.get_image_features(ref_inputs["pixel_values"], ref_inputs["image_grid_thw"])
        ours = plain[kind].target.visual(torch.cat([i.pixel_values for i in images]), [i.grid for i in images])
    torch.testing.assert_close(ours.embeds, torch.cat(ref.pooler_output), atol=1e-5, rtol=1e-5)
    ref_taps = getattr(ref, "deepstack_features", None) or []
    assert len(ours.deepstack) == len(ref_taps) == (2 if kind == "qwen3_vl" else 0)
    for tap, ref_tap in zip(ours.deepstack, ref_taps):
        torch.testing.assert_close(tap, torch.cat(ref_tap), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_transformers(kind, prompt, plain, references):
    llm, (model, processor) = plain[kind], references[kind]
    messages, names = PROMPTS[prompt]
    request = our_request(llm, messages, names)
    llm.generate_requests([request])
    text = llm.tokenizer.apply_chat_template(messages, None, add_generation_prompt=True)
    inputs = processor(text=[text], images=[IMAGES[name] for name in names], return_tensors="pt")
    assert request.prompt_ids == inputs["input_ids"][0].tolist()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    assert request.output_ids == out[0, inputs["input_ids"].shape[1]:].tolist()


def test_the_image_changes_the_answer(plain):
    """Guards the test above against a model that ignores its images."""
    llm = plain["qwen3_vl"]
    messages, _ = PROMPTS["one"]
    first, second = our_request(llm, messages, ["wide"], "a"), our_request(llm, messages, ["tall"], "b")
    llm.generate_requests([first, second])
    assert first.output_ids != second.output_ids


@pytest.mark.parametrize("kind", KINDS)
def test_dflash_chunks_and_batch_equal_plain_alone(kind, checkpoints, plain, tmp_path):
    """DFlash (the draft reads the target's features at image rows too), prefill chunks that cut
    through images (a 24-token budget), and a batch mixing image and text requests: each output
    equals the plain run of that request alone."""
    draft = write_vl_draft(tmp_path / "draft", checkpoints[kind])
    spec = LLM(str(checkpoints[kind]), draft=str(draft), show_progress=False, max_num_batched_tokens=24,
               **SMALL_POOL)
    text_only = [{"role": "user", "content": "Say something."}]
    cases = [(PROMPTS["two"][0], PROMPTS["two"][1]), (PROMPTS["one"][0], PROMPTS["one"][1]), (text_only, [])]
    expected = []
    for i, (messages, names) in enumerate(cases):
        alone = our_request(plain[kind], messages, names, f"alone-{i}") if names else plain[kind].make_request(
            f"alone-{i}", plain[kind].tokenizer.encode_chat(messages), GREEDY)
        plain[kind].generate_requests([alone])
        expected.append(alone.output_ids)
    batch = [our_request(spec, messages, names, f"spec-{i}") if names else spec.make_request(
        f"spec-{i}", spec.tokenizer.encode_chat(messages), GREEDY) for i, (messages, names) in enumerate(cases)]
    spec.generate_requests(batch)
    assert [request.output_ids for request in batch] == expected
    assert all(request.stats.speculative for request in batch)


@pytest.mark.parametrize("kind", ["qwen3_vl", "qwen3_5"])
def test_prefix_cache_keys_pages_by_image(kind, checkpoints, plain):
    """The same image in a follow-up turn hits its pages; another image of the same size shares
    only the pages before it; every output equals a run without the cache."""
    cached, fresh = plain[kind], LLM(str(checkpoints[kind]), show_progress=False, prefix_cache=False, **SMALL_POOL)
    system = {"role": "system", "content": "You are a careful assistant who looks at pictures closely. " * 3}
    turn = [system, {"role": "user", "content": [image_part("wide"), {"type": "text", "text": "What is it?"}]}]

    def run(llm: LLM, messages: list[dict], names: list[str], request_id: str):
        request = our_request(llm, messages, names, request_id)
        llm.generate_requests([request])
        return request

    first = run(cached, turn, ["wide"], "t1")
    image_start = first.multimodal.starts[0]
    follow_up = turn + [{"role": "assistant", "content": cached.tokenizer.decode(first.output_ids, True)},
                        {"role": "user", "content": "And the colours?"}]
    second = run(cached, follow_up, ["wide"], "t2")
    page = cached.config.page_size
    image_end = image_start + first.multimodal.images[0].num_tokens
    assert second.stats.cached_tokens >= image_end // page * page > image_start
    assert second.output_ids == run(fresh, follow_up, ["wide"], "f2").output_ids
    other = run(cached, turn, ["tall"], "t3")
    assert other.stats.cached_tokens <= image_start
    if kind == "qwen3_vl":      # a hybrid hit needs a snapshot there, which only the prompt's end has
        assert other.stats.cached_tokens > 0
    assert other.output_ids == run(fresh, turn, ["tall"], "f3").output_ids


def test_the_startup_capture_forwards_run_on_a_vision_model(checkpoints, plain):
    """CUDA startup captures every bucket on padding rows of a request-less sequence (the runner's
    idle forwards: verify rows, a prefill chunk, the draft's blocks), which carry no images; on a
    vision-language target they run, and change no later output."""
    llm = plain["qwen3_5"]
    request = our_request(llm, *PROMPTS["one"], "before")
    llm.generate_requests([request])
    runner = llm.engine.runner
    runner.idle_forward("verify", 4)
    runner.idle_forward("piecewise", 8)
    again = our_request(llm, *PROMPTS["one"], "after")
    llm.generate_requests([again])
    assert again.output_ids == request.output_ids


LONG_TAIL = [{"role": "user", "content": [image_part("wide"), {"type": "text", "text": (
    "Describe the picture: its colours, its shapes, what it shows and where, and what it might mean, "
    "in three short sentences.")}]}]


def test_rows_no_image_reaches_rotate_at_one_shift_of_their_positions(plain):
    """The graphs' premise: any window of an image sequence's rows (prompt rows, and rows past
    it) that reaches no image's rows rotates, on all three M-RoPE axes, at its cache positions +
    one shift (`rope_offset`): 0 before the first image, another between the images, rope_delta
    after the last."""
    request = our_request(plain["qwen3_vl"], *PROMPTS["two"])
    seq, length = SimpleNamespace(request=request), len(request.prompt_ids)
    shifts = set()
    for start in range(length + 4):
        for n in (1, 3, 8):
            entry = Entry(seq, start, [0] * n)
            shift = rope_offset(entry)
            if shift is not None:
                assert torch.equal(rope_columns(entry), (torch.arange(start, start + n) + shift).expand(3, -1))
                shifts.add(shift)
    assert len(shifts) == 3 and {0, request.multimodal.rope_delta} < shifts


def expected_alone(llm: LLM, cases: list[tuple[list[dict], list[str], SamplingParams]]) -> list[list[int]]:
    """Each case run alone on llm (eager, one prefill chunk: every row at step_rows' M-RoPE positions)."""
    outputs = []
    for i, (messages, names, params) in enumerate(cases):
        request = our_request(llm, messages, names, f"alone-{i}", params)
        llm.generate_requests([request])
        outputs.append(request.output_ids)
    return outputs


@pytest.mark.parametrize("kind", ["qwen3_vl", "qwen3_5"])
def test_image_sequences_step_through_the_graphs_path(kind, checkpoints, plain, tmp_path):
    """The dispatcher's padded shapes (capture=False: a CUDA graph's shapes, run eagerly), plain and
    DFlash, image and text requests in one batch prefilled in chunks of a 24-token budget: every
    decode / verify step and every draft propose holding an image sequence plans FULL, the chunks
    of text after an image PIECEWISE, only the chunks reaching image rows EAGER; each output
    equals the eager run of its request alone (the text one decodes long enough to share FULL
    steps with them)."""
    cases = [(LONG_TAIL, ["wide"], GREEDY), (*PROMPTS["two"], GREEDY),
             ([{"role": "user", "content": "Say something."}], [], SamplingParams(max_tokens=60, temperature=0.0))]
    expected = expected_alone(plain[kind], cases)
    draft = write_vl_draft(tmp_path / "draft", checkpoints[kind])
    for name, draft_dir in (("plain", None), ("dflash", str(draft))):
        llm = LLM(str(checkpoints[kind]), draft=draft_dir, show_progress=False, max_num_batched_tokens=24,
                  **SMALL_POOL)
        padded(llm.engine)
        seen = record_forwards(llm.engine.runner)
        batch = [our_request(llm, *case[:2], f"{name}-{i}", case[2]) for i, case in enumerate(cases)]
        llm.generate_requests(batch)
        assert [request.output_ids for request in batch] == expected, name
        with_images = [f for f in seen if f.images]
        assert {f.mode for f in with_images if not f.prefill} == {FULL}, name
        assert any(f.text and not (f.prefill or f.draft) for f in with_images), name
        assert {f.mode for f in with_images if f.prefill and not f.image_rows} == {PIECEWISE}, name
        assert {f.mode for f in with_images if f.image_rows} == {EAGER}, name
        assert (name == "dflash") == any(f.draft for f in with_images)
        assert all(request.stats.speculative == (name == "dflash") for request in batch)


@pytest.mark.parametrize("kind", ["qwen3_vl", "qwen3_5"])
def test_a_second_turn_after_an_image_on_the_graphs_path_equals_transformers(kind, checkpoints, references):
    """The follow-up turn hits the first turn's pages past its image, so its prefill is text
    after an image (PIECEWISE, at the image's M-RoPE shift) and its decode FULL: greedy output
    equals transformers' generate on the whole conversation."""
    llm, (model, processor) = LLM(str(checkpoints[kind]), show_progress=False, **SMALL_POOL), references[kind]
    padded(llm.engine)
    turn, names = LONG_TAIL, ["wide"]
    first = our_request(llm, turn, names, "t1")
    llm.generate_requests([first])
    follow_up = turn + [{"role": "assistant", "content": llm.tokenizer.decode(first.output_ids, True)},
                        {"role": "user", "content": "And the colours?"}]
    seen = record_forwards(llm.engine.runner)
    second = our_request(llm, follow_up, names, "t2")
    llm.generate_requests([second])
    assert second.stats.cached_tokens >= first.multimodal.image_rows()[-1][1]
    assert {(f.mode, f.image_rows) for f in seen if f.prefill} == {(PIECEWISE, False)}
    assert {f.mode for f in seen if not f.prefill} == {FULL}
    text = llm.tokenizer.apply_chat_template(follow_up, None, add_generation_prompt=True)
    inputs = processor(text=[text], images=[IMAGES[name] for name in names], return_tensors="pt")
    assert second.prompt_ids == inputs["input_ids"][0].tolist()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    assert second.output_ids == out[0, inputs["input_ids"].shape[1]:].tolist()


def test_make_request_refuses_images_for_a_text_model():
    text_only = SimpleNamespace(target=SimpleNamespace(visual=None))
    with pytest.raises(ValueError, match="no images"):
        LLM.make_request(text_only, "x", [1, 2, 3], GREEDY, multimodal=object())


def test_tensor_parallel_takes_no_images():
    """Its workers see no request's images (distributed/runner.py: RequestView): refused, not run."""
    sharded = SimpleNamespace(target=SimpleNamespace(visual=object()), workers=object())
    assert not LLM.takes_images.fget(sharded)
    with pytest.raises(ValueError, match="tensor parallel"):
        LLM.make_request(sharded, "x", [1, 2, 3], GREEDY, multimodal=object())


def test_image_urls_under_the_media_policy(tmp_path):
    image = IMAGES["wide"]
    assert load_image(data_url(image), MediaPolicy()).size == image.size
    (tmp_path / "inside").mkdir()
    image.save(tmp_path / "inside" / "a.png")
    image.save(tmp_path / "outside.png")
    policy = MediaPolicy(local_dir=tmp_path / "inside", max_bytes=1 << 16)
    assert load_image(f"file://{tmp_path}/inside/a.png", policy).size == image.size
    refusals = {
        f"file://{tmp_path}/inside/../outside.png": "under",
        f"file://{tmp_path}/outside.png": "under",
        "data:image/png;base64,AAAA": "decoded",
        "data:text/plain;base64,aGk=": "not an image",
        "data:image/png;base64,!!!": "base64",
        "http://127.0.0.1:9/x.png": "failed",
        "ftp://example.com/x.png": "data: URL",
    }
    for url, reason in refusals.items():
        with pytest.raises(ImageError, match=reason):
            load_image(url, policy)
    with pytest.raises(ImageError, match="does not fetch"):
        load_image("https://example.com/x.png", MediaPolicy(allow_remote=False))
    with pytest.raises(ImageError, match="only from"):
        load_image("https://example.com/x.png", MediaPolicy(allowed_domains=("images.example.org",)))
    with pytest.raises(ImageError, match="limit"):
        load_image(data_url(random_image(64, 64, seed=9)), MediaPolicy(max_bytes=1000))
    with pytest.raises(ImageError, match="pixels"):
        load_image(data_url(image), MediaPolicy(max_pixels=100))


# -- the server ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(checkpoints):
    """A served qwen3_vl (its own engine: the server's thread steps it) taking at most 2 images
    of at most 64 KiB each."""
    from blockspec.server.app import ServerSettings
    from servers import InProcessServer
    llm = LLM(str(checkpoints["qwen3_vl"]), show_progress=False, **SMALL_POOL)
    settings = ServerSettings(model="vl", limit_images_per_prompt=2, max_image_bytes=64 << 10,
                              media_fetch_timeout=2.0, log_stats_interval=0)
    with InProcessServer(lambda: llm, settings) as running:
        yield running


def test_openai_client_image_url_equals_in_process(server, plain):
    import openai
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    content = [{"type": "text", "text": "Compare"}, {"type": "image_url", "image_url": {"url": data_url(IMAGES["tall"])}},
               {"type": "text", "text": "with"}, {"type": "image_url", "image_url": {"url": data_url(IMAGES["wide"])}}]
    reply = client.chat.completions.create(model="vl", messages=[{"role": "user", "content": content}],
                                           temperature=0, max_tokens=MAX_TOKENS)
    llm = plain["qwen3_vl"]
    request = our_request(llm, *PROMPTS["two"])
    llm.generate_requests([request])
    assert reply.usage.prompt_tokens == len(request.prompt_ids)
    assert reply.usage.completion_tokens == len(request.output_ids)
    message = reply.choices[0].message     # the template opens <think>: the answer so far is reasoning
    text = (message.model_extra.get("reasoning_content") or "") + (message.content or "")
    assert text == llm.tokenizer.decode(request.output_ids, skip_special_tokens=True) and text
    response = client.responses.create(model="vl", max_output_tokens=MAX_TOKENS, temperature=0, input=[{
        "role": "user", "content": [{"type": "input_text", "text": "Compare"},
                                    {"type": "input_image", "image_url": data_url(IMAGES["tall"])},
                                    {"type": "input_text", "text": "with"},
                                    {"type": "input_image", "image_url": data_url(IMAGES["wide"])}]}])
    reasoning = "".join(part.text for item in response.output if item.type == "reasoning" for part in item.content)
    assert reasoning + response.output_text == text
    again = client.chat.completions.create(model="vl", messages=[{"role": "user", "content": content}],
                                           temperature=0, max_tokens=MAX_TOKENS)
    page = llm.config.page_size
    assert again.usage.prompt_tokens_details.cached_tokens == (len(request.prompt_ids) - 1) // page * page > 0


def test_bad_images_are_400s_and_the_server_keeps_serving(server):
    import base64
    import httpx

    def chat(*urls: str) -> httpx.Response:
        content = [{"type": "text", "text": "Look:"}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
        return httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
            "model": "vl", "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": content}]})

    good = data_url(IMAGES["wide"])
    not_an_image = "data:image/png;base64," + base64.b64encode(b"\x89PNG but not really" * 8).decode()
    cases = {
        "not an image": (not_an_image,),
        "too large": (data_url(random_image(200, 200, seed=5)),),
        "unreachable": ("http://127.0.0.1:9/image.png",),
        "too many": (good, good, good),
        "local files off": ("file:///etc/hostname",),
    }
    for name, urls in cases.items():
        response = chat(*urls)
        assert response.status_code == 400, (name, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], name
        assert error["param"] == ("messages" if name == "too many" else "messages[0].content[1].image_url"), name
        assert chat(good).status_code == 200, name


def test_a_text_model_refuses_images_by_name():
    from blockspec.server.errors import ApiError
    from blockspec.server.images import check_images
    from blockspec.server.protocol import ChatCompletionRequest
    from blockspec.server.settings import ServerSettings

    class TextOnly:
        takes_images = False

    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]})
    with pytest.raises(ApiError, match="takes no images") as error:
        check_images(TextOnly(), ServerSettings(model="m"), body)
    assert error.value.status == 400 and error.value.param == "messages[0].content[0].image_url"


def test_http_images_fetched_with_limits(tmp_path):
    """A local HTTP server: an image is fetched and decodes as sent; a 404, a body over the byte
    limit, a host off the allowed list and a redirect to one are refused."""
    import functools
    import http.server
    import threading

    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/moved":
                self.send_response(302)
                self.send_header("Location", "http://elsewhere.invalid/a.png")
                self.end_headers()
                return
            super().do_GET()

        def log_message(self, *args):
            pass

    IMAGES["wide"].save(tmp_path / "a.png")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        fetched = load_image(base + "/a.png", MediaPolicy(allowed_domains=("127.0.0.1",)))
        assert fetched.tobytes() == IMAGES["wide"].convert("RGB").tobytes()
        for url, policy, reason in [
            (base + "/missing.png", MediaPolicy(), "HTTP 404"),
            (base + "/a.png", MediaPolicy(max_bytes=100), "limit"),
            (base + "/a.png", MediaPolicy(allowed_domains=("example.org",)), "only from"),
            (base + "/moved", MediaPolicy(allowed_domains=("127.0.0.1",)), "redirects"),
        ]:
            with pytest.raises(ImageError, match=reason):
                load_image(url, policy)
    finally:
        server.shutdown()


# -- audit 64d: images of one size, and two image sequences in one step -------------------------

TWINS = (random_image(37, 53, seed=11), random_image(37, 53, seed=12))      # one size, other pixels


def twin_request(llm: LLM, image, request_id: str):
    """PROMPTS["one"]'s text around `image`: twins make the same prompt ids, placeholders included."""
    ids = llm.tokenizer.encode_chat(PROMPTS["one"][0])
    ids, prompt = llm.image_prompt(ids, [process_image(image, llm.image_processor)])
    return llm.make_request(request_id, ids, GREEDY, multimodal=prompt)


@pytest.fixture(scope="module")
def twin_answers(plain, references) -> list[list[int]]:
    """transformers' greedy answer of qwen3_vl to PROMPTS["one"] about each twin."""
    model, processor = references["qwen3_vl"]
    text = plain["qwen3_vl"].tokenizer.apply_chat_template(PROMPTS["one"][0], None, add_generation_prompt=True)
    answers = []
    for image in TWINS:
        inputs = processor(text=[text], images=[image], return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
        answers.append(out[0, inputs["input_ids"].shape[1]:].tolist())
    assert answers[0] != answers[1]            # the pixels decide the answer, not the prompt's ids
    return answers


def test_images_of_one_size_never_share_cached_pages(plain, twin_answers):
    """Two images of the same size (so the same placeholder rows in the same text) but other
    pixels: the second request reuses only pages before its image, and answers about its own."""
    llm = plain["qwen3_vl"]
    first, second = twin_request(llm, TWINS[0], "twin-0"), twin_request(llm, TWINS[1], "twin-1")
    assert first.prompt_ids == second.prompt_ids
    llm.generate_requests([first])
    llm.generate_requests([second])
    assert second.stats.cached_tokens <= second.multimodal.starts[0]
    assert [first.output_ids, second.output_ids] == twin_answers


def test_two_image_requests_in_one_step_then_preempted_answer_as_transformers(checkpoints, twin_answers):
    """Both prompts prefill in one step (each image's tokens go to its own rows of the step); an
    out-of-memory at their third decode step preempts both, and each recomputes its prompt and
    its output so far in one chunk (the output rows at the prompt's M-RoPE shift). No prefix
    cache: the recompute runs through the image again. Each answers as transformers does."""
    llm = LLM(str(checkpoints["qwen3_vl"]), show_progress=False, prefix_cache=False, **SMALL_POOL)
    scheduler, decode_steps, preempted = llm.engine.scheduler, [], []
    preempt = scheduler.preempt
    scheduler.preempt = lambda seq: (preempted.append(seq.request_id), preempt(seq))[1]
    launch, prefills = llm.engine.runner.launch, []
    llm.engine.runner.launch = lambda step: (prefills.append(len(step.prefill)), launch(step))[1]

    def out_of_memory_at_the_third_decode(stage: str, seqs) -> None:
        if stage == "decode":
            decode_steps.append(len(seqs))
            if len(decode_steps) == 3:
                raise torch.OutOfMemoryError("injected")

    llm.engine.fault_hook = out_of_memory_at_the_third_decode
    batch = [twin_request(llm, image, f"both-{i}") for i, image in enumerate(TWINS)]
    llm.generate_requests(batch)
    assert prefills[0] == 2 and decode_steps[:3] == [2, 2, 2]
    assert sorted(preempted) == ["both-0", "both-1"]
    assert [request.output_ids for request in batch] == twin_answers
