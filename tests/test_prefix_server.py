"""The prefix cache through the server and the official openai client: a second chat turn
reports usage.prompt_tokens_details.cached_tokens > 0 and answers as a server with
--no-prefix-cache does; /metrics counts the lookups and hits in tokens."""
from __future__ import annotations

import httpx
import openai
import pytest

from api_server import LiveServer, load_llm

SYSTEM = ("You are a careful assistant. Answer briefly, cite nothing, and keep every reply under "
          "fifty words. Never invent facts; say so when you do not know. ") * 3


@pytest.fixture(scope="module")
def servers(qwen3_dir, qwen3_draft_dir):
    with LiveServer(load_llm(qwen3_dir, qwen3_draft_dir, block_size=4), "qwen3") as on, \
            LiveServer(load_llm(qwen3_dir, qwen3_draft_dir, block_size=4, prefix_cache=False), "qwen3") as off:
        yield on, off


def two_turns(server: LiveServer) -> list:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a page?"}]
    responses = []
    for question in ("And a radix tree?", None):
        response = client.chat.completions.create(model="qwen3", messages=messages, temperature=0, max_tokens=12)
        responses.append(response)
        if question is not None:
            messages += [{"role": "assistant", "content": response.choices[0].message.content},
                         {"role": "user", "content": question}]
    return responses


def test_second_turn_reports_cached_tokens_and_the_same_answer(servers):
    on, off = servers
    with_cache, without = two_turns(on), two_turns(off)
    assert [r.choices[0].message.content for r in with_cache] == [r.choices[0].message.content for r in without]
    first, second = (r.usage for r in with_cache)
    assert first.prompt_tokens_details.cached_tokens == 0
    assert 0 < second.prompt_tokens_details.cached_tokens < second.prompt_tokens
    assert second.prompt_tokens_details.cached_tokens >= first.prompt_tokens // 16 * 16 - 16
    assert all(r.usage.prompt_tokens_details.cached_tokens == 0 for r in without)
    metrics = httpx.get(on.url + "/metrics").text
    samples = dict(line.split() for line in metrics.splitlines() if line.startswith("blockspec_prefix_cache_"))
    queries = float(samples["blockspec_prefix_cache_queries_total"])
    hits = float(samples["blockspec_prefix_cache_hits_total"])
    assert queries == first.prompt_tokens + second.prompt_tokens
    assert hits == second.prompt_tokens_details.cached_tokens


def test_n_choices_after_a_hit_count_the_cached_tokens_once(servers):
    """n = 3 on a prompt already in the cache: each choice is served from the cache, and usage
    counts the prompt and its cached tokens once, as it counts prompt_tokens."""
    on, _ = servers
    client = openai.OpenAI(base_url=on.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Count the choices."}]
    first = client.chat.completions.create(model="qwen3", messages=messages, temperature=0, max_tokens=2)
    prompt_tokens = first.usage.prompt_tokens
    three = client.chat.completions.create(model="qwen3", messages=messages, temperature=0.8, seed=3, n=3,
                                           max_tokens=2)
    assert len(three.choices) == 3 and three.usage.prompt_tokens == prompt_tokens
    assert three.usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // 16 * 16
