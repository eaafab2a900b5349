"""The playground (issue #26): the stream extension `stream_options.include_spec_cycles` held to
the server's own statistics (also when a slow reader's cycles land merged in one chunk), the
page's routes and API-key rule, and the page itself in a real headless Chromium.

The browser test needs Debian's `chromium` and `chromium-driver` (.ci/run installs them) and the
`selenium` package (the test extra); it is skipped, saying so, only where they are missing.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from api_server import LiveServer, load_llm
from blockspec import demo
from blockspec.llm import LLM
from blockspec.server.app import ServerSettings, create_app
from servers import wait_until

CODE_PROMPT = "def merge_sorted(a, b):"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver") or ("/usr/bin/chromedriver" if os.path.exists("/usr/bin/chromedriver") else None)


@pytest.fixture(scope="module")
def demo_llm() -> LLM:
    target, draft = demo.require_built()
    # Fixed: a request's cycles are then the same each time it runs alone (adaptive's widths follow
    # what the policy has learnt by then), which the cycle tests compare.
    return LLM(str(target), draft=str(draft), device="cpu", show_progress=False, speculation="fixed")


@pytest.fixture(scope="module")
def server(demo_llm):
    with LiveServer(demo_llm, "demo") as live:
        yield live


def chat_body(max_tokens: int, **fields) -> dict:
    return {"messages": [{"role": "user", "content": CODE_PROMPT}], "max_tokens": max_tokens, "temperature": 0,
            "stream_options": {"include_spec_cycles": True, "include_usage": True}, "return_meta_info": True, **fields}


def histogram_of(cycles: list[dict]) -> list[int]:
    """meta_info's spec_accept_histogram from cycle entries: [i] = verify passes accepting i drafts."""
    counts = Counter(c["accepted"] for c in cycles if c["cycle"] > 0)
    return [counts[i] for i in range(max(counts) + 1)] if counts else []


def assert_cycles_match(chunks: list[dict], completion_tokens: int) -> list[dict]:
    """The cycle entries of a stream agree with its text, usage and meta_info; returns them."""
    cycles = [entry for chunk in chunks for entry in chunk.get("spec_cycles", [])]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    meta = next(c["meta_info"] for c in chunks if "meta_info" in c)
    verify = [c for c in cycles if c["cycle"] > 0]
    assert [c["cycle"] for c in verify] == list(range(1, len(verify) + 1))
    assert [c["cycle"] for c in cycles if c["cycle"] == 0] == [0]           # the prefill's one token
    assert sum(c["tokens"] for c in cycles) == completion_tokens
    assert all(len(c["text"]) == c["tokens"] for c in cycles)
    assert "".join(t for c in cycles for t in c["text"]) == content
    assert all(c["bonus"] == c["tokens"] - 1 == c["accepted"] for c in verify)
    assert len(verify) == meta["spec_verify_ct"]
    assert histogram_of(cycles) == meta["spec_accept_histogram"]
    assert sum(c["accepted"] for c in verify) == meta["spec_accept_token_num"]
    assert sum(c["drafts"] for c in verify) == meta["spec_draft_token_num"]
    return cycles


# ---------------------------------------------------------------------------------------------
# The stream extension
# ---------------------------------------------------------------------------------------------


def test_spec_cycles_agree_with_the_servers_statistics(server):
    events = server.stream("/v1/chat/completions", chat_body(48))
    chunks = events[:-1]
    cycles = assert_cycles_match(chunks, chunks[-1]["usage"]["completion_tokens"])
    assert any(c["accepted"] > 0 for c in cycles)          # the demo draft is trained: some accepted
    plain = server.stream("/v1/chat/completions", {**chat_body(48), "stream_options": {"include_usage": True}})
    assert all("spec_cycles" not in event for event in plain[:-1])                     # opt-in only
    plain_text = "".join(c["choices"][0]["delta"].get("content") or "" for c in plain[:-1] if c["choices"])
    assert plain_text and plain_text == "".join(t for c in cycles for t in c["text"])  # the same output


def test_spec_cycles_on_completions_and_on_a_plain_server(server, demo_llm):
    events = server.stream("/v1/completions", {"prompt": CODE_PROMPT, "max_tokens": 24, "temperature": 0,
                                               "stream_options": {"include_spec_cycles": True}})
    cycles = [e for event in events[:-1] for e in event.get("spec_cycles", [])]
    text = "".join(c["choices"][0]["text"] for c in events[:-1] if c["choices"])
    assert sum(c["tokens"] for c in cycles) == 24 and "".join(t for c in cycles for t in c["text"]) == text
    plain_llm = LLM(str(demo.TARGET_DIR), device="cpu", show_progress=False)
    with LiveServer(plain_llm, "plain") as plain:
        events = plain.stream("/v1/chat/completions", chat_body(12))
        cycles = [e for event in events[:-1] for e in event.get("spec_cycles", [])]
        # plain decoding: one token per step, nothing drafted
        assert [(c["tokens"], c["accepted"], c["drafts"]) for c in cycles] == [(1, 0, 0)] * 12


def stream_with_a_stalled_loop(server: LiveServer, body: dict, stall_s: float) -> list[dict]:
    """Stream body; after the third chunk the server's event loop is blocked for stall_s, as a
    slow reader leaves it: the engine thread runs on and merges its events into the one pending."""
    loop, chunks = server.app.state.server.loop, []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
                if len(chunks) == 3:
                    loop.call_soon_threadsafe(time.sleep, stall_s)
    return chunks


def test_spec_cycles_stay_exact_when_a_slow_reader_gets_them_merged(server):
    """While the loop is stalled the engine's cycles wait merged in one pending event and come
    out in one chunk, each still with its own counts: the same as read one by one."""
    body = chat_body(160)
    merged = stream_with_a_stalled_loop(server, body, stall_s=1.5)
    assert max(len(c.get("spec_cycles", [])) for c in merged) > 3
    cycles = assert_cycles_match(merged, merged[-1]["usage"]["completion_tokens"])
    one_by_one = [e for c in server.stream("/v1/chat/completions", body)[:-1] for e in c.get("spec_cycles", [])]
    assert cycles == one_by_one             # greedy, alone on the server: the same cycles


class LetterDetokenizer:
    """Token id i is the letter chr(ord('a') + i): each id's text is known exactly."""

    def add(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids)

    def flush(self) -> str:
        return ""


def test_spec_cycles_records_are_token_ranges_whatever_the_events_merge_into():
    """The engine's callbacks as it makes them (prefill token, then one verify pass each), read
    merged, a re-prefill after a preemption in the middle, and a stop string cutting the last
    cycle: every record keeps its own counts and its tokens' texts."""
    from blockspec.engine.request import GenerationStats, TokenEvent
    from blockspec.server.generation import merge_events
    from blockspec.server.output import OutputProcessor
    from blockspec.server.spec_cycles import SpecCycles
    stats, cycles = GenerationStats(), SpecCycles()

    def emit(token_ids: list[int], verified: tuple[int, int] | None, finish: str | None = None) -> TokenEvent:
        if verified is not None:                 # what record_cycle did just before the callback
            length, drafts = verified
            stats.acceptance_lengths.append(length)
            stats.draft_tokens += drafts
        event = TokenEvent("r", token_ids, finish)
        cycles.record(event, stats)
        return event

    first = emit([0], None)                              # the prefill's token
    one = emit([1, 2, 3], (3, 7))                        # 2 accepted + bonus
    two = emit([4], (1, 7))
    again = emit([5], None)                              # preempted, recomputed: a prefill token
    three = emit([6, 7, 8, 9], (4, 5))
    last = emit([10, 11, 12, 13], (4, 7), "length")
    processor = OutputProcessor(LetterDetokenizer(), stop=["jk"])     # j is held, then k completes the stop
    entries = []
    for event in (first, merge_events(merge_events(one, two), again), merge_events(three, last)):
        delta = cycles.process(processor, event)
        taken = cycles.take() or []
        assert delta.content == "".join(text for entry in taken for text in entry["text"])
        entries += taken
    assert [(e["cycle"], e["tokens"], e["accepted"], e["drafts"], e["bonus"]) for e in entries] == [
        (0, 1, 0, 0, None), (1, 3, 2, 7, 2), (2, 1, 0, 7, 0), (0, 1, 0, 0, None), (3, 4, 3, 5, 3), (4, 4, 3, 7, 3)]
    assert [e["text"] for e in entries] == [["a"], ["b", "c", "d"], ["e"], ["f"], ["g", "h", "i", ""], ["", "", "", ""]]
    assert processor.finish_reason == "stop" and processor.completion_tokens == 11


# ---------------------------------------------------------------------------------------------
# The page's routes
# ---------------------------------------------------------------------------------------------


def test_the_page_is_served_with_its_files_only(server):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for name, kind in (("playground.js", "text/javascript"), ("playground.css", "text/css")):
        asset = httpx.get(f"{server.url}/ui/{name}")
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind)
        assert f'"ui/{name}"' in page.text
    for name in ("../app.py", "__init__.py", "index.htm"):
        missing = httpx.get(f"{server.url}/ui/{name}")
        assert missing.status_code == 404 and "error" in missing.json()
    # nothing from elsewhere: the page links its own files, relatively (it works behind a path
    # prefix too), and an inline icon, only
    links = re.findall(r'(?:src|href)="([^"]*)"', page.text)
    assert links and all(link.startswith(("ui/", "data:image/svg+xml,")) for link in links)
    script, style = (httpx.get(f"{server.url}/ui/{name}").text for name in ("playground.js", "playground.css"))
    assert "http" not in script and "url(" not in style and "@import" not in style


def test_no_ui_and_the_api_key_rule(qwen3_dir):
    # a server's shutdown stops its LLM's engine: each server here has its own (tiny) LLM
    with LiveServer(load_llm(qwen3_dir), "qwen3", ui=False) as live:
        assert httpx.get(live.url + "/").status_code == 404
        assert httpx.get(live.url + "/ui/playground.js").status_code == 404
    with LiveServer(load_llm(qwen3_dir), "qwen3", api_key="sesame") as live:
        assert httpx.get(live.url + "/").status_code == 200              # the page holds no data
        body = {"model": "qwen3", **chat_body(4)}
        assert httpx.post(live.url + "/v1/chat/completions", json=body).status_code == 401
        answer = httpx.post(live.url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer sesame"})
        assert answer.status_code == 200


def test_the_cli_turns_the_page_off():
    from blockspec.cli import build_parser
    from blockspec.options import SERVE, from_namespace

    def settings(*flags: str) -> ServerSettings:
        return from_namespace(ServerSettings, build_parser().parse_args(["serve", *flags]), SERVE)
    assert settings().ui is True and settings("--no-ui").ui is False
    assert create_app(lambda: None, ServerSettings(model="m", ui=False)) is not None


# ---------------------------------------------------------------------------------------------
# The page in a real headless Chromium
# ---------------------------------------------------------------------------------------------


def metrics(url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("no headless browser here: the playground test needs Debian's chromium and chromium-driver "
                    "(`apt-get install -y chromium chromium-driver`; .ci/run installs them)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium (the test extra) is not installed")
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     "--window-size=1360,860", "--force-device-scale-factor=1"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def artefact_dir(tmp_path: Path) -> Path:
    directory = Path(os.environ.get("BLOCKSPEC_TEST_ARTIFACTS", tmp_path))
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def set_control(driver, element_id: str, value: str) -> None:
    driver.execute_script("const e = document.getElementById(arguments[0]); e.value = arguments[1];"
                          "e.dispatchEvent(new Event('input'));", element_id, value)


def send_message(driver, text: str) -> None:
    box = driver.find_element("id", "prompt")
    box.clear()
    box.send_keys(text)
    driver.find_element("id", "send").click()


def last_answer(driver):
    return driver.find_elements("css selector", ".message.assistant")[-1]


def wait_for(condition, timeout: float = 60.0) -> None:
    assert wait_until(condition, timeout=timeout, interval=0.05), "timed out waiting in the browser"


def test_the_playground_in_chromium(browser, server, tmp_path):
    driver = browser
    driver.get(server.url + "/")
    wait_for(lambda: driver.find_element("id", "server-status").get_attribute("data-status") == "ok")
    assert "block 8" in driver.find_element("id", "model-info").text
    set_control(driver, "temperature", "0")
    set_control(driver, "max-tokens", "64")

    # One answer: its cycle groups are exactly the server's verify passes for it.
    before = metrics(server.url)
    send_message(driver, CODE_PROMPT)
    wait_for(lambda: last_answer(driver).get_attribute("data-state") == "done")
    answer = last_answer(driver)
    after = metrics(server.url)
    groups = [{key: int(group.get_attribute(f"data-{key}")) for key in ("cycle", "tokens", "accepted", "drafts")}
              for group in answer.find_elements("css selector", ".cycle")]
    verify = [g for g in groups if g["cycle"] > 0]
    assert groups[0]["cycle"] == 0 and [g["cycle"] for g in verify] == list(range(1, len(verify) + 1))
    assert len(verify) == after["blockspec_spec_verify_total"] - before["blockspec_spec_verify_total"]
    assert sum(g["accepted"] for g in verify) == \
        after["blockspec_spec_accepted_tokens_total"] - before["blockspec_spec_accepted_tokens_total"]
    assert sum(g["drafts"] for g in verify) == \
        after["blockspec_spec_draft_tokens_total"] - before["blockspec_spec_draft_tokens_total"]
    assert sum(g["tokens"] for g in groups) == 64 == int(answer.get_attribute("data-completion-tokens"))
    meta = json.loads(answer.get_attribute("data-meta-info"))
    assert histogram_of(groups) == meta["spec_accept_histogram"]
    # each verify group ends in its bonus token; equal counts share a colour, different ones don't
    for group in answer.find_elements("css selector", ".cycle:not(.prefill)"):
        tokens = group.find_elements("css selector", ".tok")
        assert "bonus" in tokens[-1].get_attribute("class").split()
        assert not any("bonus" in t.get_attribute("class").split() for t in tokens[:-1])
    colours: dict[int, set[str]] = {}
    for group, element in zip(groups, answer.find_elements("css selector", ".cycle")):
        if group["cycle"] > 0:
            colours.setdefault(group["accepted"], set()).add(element.value_of_css_property("background-color"))
    assert all(len(c) == 1 for c in colours.values()) and len(set.union(*colours.values())) == len(colours) >= 2
    # the last answer's figures: the histogram drawn, the mean acceptance length
    columns = driver.find_elements("css selector", "#histogram .col")
    drawn = {int(c.get_attribute("data-accepted")): int(c.get_attribute("data-count")) for c in columns}
    assert [drawn.get(i, 0) for i in range(len(meta["spec_accept_histogram"]))] == meta["spec_accept_histogram"]
    tau = sum(g["tokens"] for g in verify) / len(verify)
    assert driver.find_element("id", "stat-tau").text == f"{tau:.2f}"
    assert float(driver.find_element("id", "stat-rate").text) > 0
    wait_for(lambda: driver.find_element("id", "live-running").text == "0")
    driver.save_screenshot(str(artefact_dir(tmp_path) / "playground.png"))

    # Stop mid-stream: text is seen streaming, the server's running count returns to 0.
    aborted = metrics(server.url).get('blockspec_requests_total{finish_reason="abort"}', 0.0)
    set_control(driver, "max-tokens", "700")
    send_message(driver, "class Stack:")
    wait_for(lambda: len(driver.find_elements("css selector", ".message.assistant")) == 2)
    streaming = last_answer(driver)
    wait_for(lambda: len(streaming.find_elements("css selector", ".cycle")) >= 3)
    assert streaming.get_attribute("data-state") == "streaming" and streaming.find_element("css selector", ".body").text
    driver.find_element("id", "stop").click()
    wait_for(lambda: streaming.get_attribute("data-state") == "stopped")
    wait_for(lambda: metrics(server.url)["blockspec_requests_running"] == 0, timeout=30)
    assert metrics(server.url)['blockspec_requests_total{finish_reason="abort"}'] == aborted + 1
    wait_for(lambda: driver.find_element("id", "live-running").text == "0")
    assert sum(int(g.get_attribute("data-tokens")) for g in streaming.find_elements("css selector", ".cycle")) < 700
    driver.save_screenshot(str(artefact_dir(tmp_path) / "playground-stopped.png"))

    # Clear empties the conversation; the page logged no error all along.
    driver.find_element("id", "clear").click()
    assert driver.find_elements("css selector", ".message") == []
    assert [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"] == []


def test_the_playground_asks_for_the_api_key(browser, qwen3_dir):
    driver = browser
    with LiveServer(load_llm(qwen3_dir), "qwen3", api_key="sesame") as live:
        driver.get(live.url + "/")                                  # the page itself is public
        wait_for(lambda: driver.find_element("id", "server-status").get_attribute("data-status") == "ok")
        assert not driver.find_element("id", "api-key-row").is_displayed()
        set_control(driver, "max-tokens", "4")
        send_message(driver, "Hello")
        wait_for(lambda: last_answer(driver).get_attribute("data-state") == "error")
        assert "API key" in driver.find_element("id", "error").text
        assert driver.find_element("id", "api-key-row").is_displayed()
        driver.find_element("id", "api-key").send_keys("sesame")
        send_message(driver, "Hello")
        wait_for(lambda: last_answer(driver).get_attribute("data-state") == "done")
        assert last_answer(driver).get_attribute("data-completion-tokens") == "4"
        assert not driver.find_element("id", "error").is_displayed()


def test_the_playground_sends_and_shows_images(browser, tmp_path):
    """An image attached through the file input (and one pasted) shows in the conversation and
    goes to a multimodal model as an image_url part; the next turn sends it again (history)."""
    import base64
    import io
    from vision_fixtures import random_image, write_vl_checkpoint
    driver = browser
    directory, _ = write_vl_checkpoint(tmp_path / "vl", "qwen3_vl")
    llm = LLM(str(directory), show_progress=False, max_model_len=1024, kv_cache_memory=32 << 20)
    buffer = io.BytesIO()
    random_image(37, 53, seed=1).save(buffer, format="PNG")
    png = base64.b64encode(buffer.getvalue()).decode()
    attach = ("const bytes = Uint8Array.from(atob(arguments[0]), (c) => c.charCodeAt(0));"
              "const data = new DataTransfer(); data.items.add(new File([bytes], 'a.png', {type: 'image/png'}));"
              "const input = document.getElementById(arguments[1]);")
    driver.get("about:blank")      # the earlier test's page stops polling its (stopped) server,
    driver.get_log("browser")      # and the shared browser's log drops that test's entries (its 401s)
    with LiveServer(llm, "vl") as live:
        driver.get(live.url + "/")
        wait_for(lambda: driver.find_element("id", "server-status").get_attribute("data-status") == "ok")
        set_control(driver, "temperature", "0")
        set_control(driver, "max-tokens", "4")
        driver.execute_script(attach + "input.files = data.files; input.dispatchEvent(new Event('change'));",
                              png, "image-file")
        wait_for(lambda: len(driver.find_elements("css selector", "#attachments img")) == 1)
        driver.execute_script(attach + "const event = new Event('paste'); event.clipboardData = data;"
                              "input.dispatchEvent(event);", png, "prompt")
        wait_for(lambda: len(driver.find_elements("css selector", "#attachments img")) == 2)
        send_message(driver, "What is this?")
        wait_for(lambda: last_answer(driver).get_attribute("data-state") == "done")
        shown = driver.find_elements("css selector", ".message.user .images img")
        assert len(shown) == 2 and all(img.get_attribute("src").startswith("data:image/png") for img in shown)
        assert driver.find_elements("css selector", "#attachments img") == []
        send_message(driver, "And now?")
        wait_for(lambda: last_answer(driver).get_attribute("data-state") == "done")
        assert not driver.find_element("id", "error").is_displayed()
        assert [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"] == []
