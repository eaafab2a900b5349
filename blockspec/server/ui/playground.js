// The blockspec playground: chat through this server's /v1/chat/completions, drawing each DFlash
// verify cycle from the stream extension `stream_options.include_spec_cycles` (ARCHITECTURE.md
// §5): every chunk carries, per cycle whose tokens it holds, {cycle, tokens, accepted, drafts,
// bonus, text[]}. Cycle 0 is the prefill's token. All text goes in through textContent.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "blockspec-api-key";

const state = {
  history: [],            // [{role, content}] of finished turns (content: text, or parts with images)
  images: [],             // data: URLs attached to the next message
  controller: null,       // the AbortController of the answer streaming now
  blockSize: null,        // from /health: drafts per cycle = blockSize - 1
  speculative: false,
  loaded: false,          // /health answered ok
  lastMetrics: null,      // {time, generated} of the previous /metrics poll
};

// ---- colours: one per accepted count, grey for none, then blue → green → gold -------------

function maxAccepted() {
  return Math.max(1, (state.blockSize || 8) - 1);
}

function cycleColour(accepted) {
  if (accepted <= 0) return "hsl(215, 16%, 91%)";
  const t = Math.min(1, accepted / maxAccepted());
  return `hsl(${Math.round(225 - 195 * t)}, 75%, ${Math.round(86 - 12 * t)}%)`;
}

function buildLegend() {
  const legend = $("legend");
  legend.textContent = "";
  if (state.loaded && !state.speculative) {
    legend.append("plain decoding: one token per step, so no drafts to show (start the server with --draft)");
    return;
  }
  legend.append("drafts accepted per cycle:");
  for (let a = 0; a <= maxAccepted(); a++) {
    const swatch = document.createElement("span");
    swatch.className = "swatch";
    swatch.style.backgroundColor = cycleColour(a);
    swatch.textContent = String(a);
    legend.append(swatch);
  }
  const bonus = document.createElement("span");
  bonus.className = "bonus-sample";
  bonus.textContent = "bonus";
  legend.append(" · ", bonus, " the target's own token · ");
  const prefill = document.createElement("span");
  prefill.className = "swatch cycle prefill";
  prefill.textContent = "first";
  legend.append(prefill, " from the prefill");
}

// ---- the server: /health once (and while loading), /metrics every second -------------------

async function loadHealth() {
  try {
    const response = await fetch("health");
    const body = await response.json();
    const status = $("server-status");
    status.dataset.status = body.status || "error";
    status.textContent = body.status || "error";
    if (body.status === "loading") { setTimeout(loadHealth, 1000); return; }
    if (body.status !== "ok") return;
    state.speculative = Boolean(body.draft) || body.block_size != null;
    state.blockSize = body.block_size;
    state.loaded = true;
    // a draft path shows as its last two parts (demo/draft; a hub id stays whole)
    const draft = body.draft ? `DFlash draft ${body.draft.split(/[\\/]/).filter(Boolean).slice(-2).join("/")}` : "DFlash draft";
    $("model-info").title = body.draft ? `${body.model} + ${body.draft}` : body.model;
    $("model-info").textContent = `${body.model} · ` + (state.speculative ? `${draft} · block ${body.block_size}` : "plain decoding");
    $("speculation-info").textContent = state.speculative
      ? `DFlash on: block size ${body.block_size}, so each verify cycle checks up to ${body.block_size - 1} drafts. ` +
        "Set when the server starts (--block-size); this server has no per-request switch."
      : "Off: this server decodes plainly (start it with --draft to speculate).";
    buildLegend();
  } catch (error) {
    $("server-status").dataset.status = "down";
    $("server-status").textContent = "unreachable";
    setTimeout(loadHealth, 2000);
  }
}

function parseMetrics(text) {
  const values = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const match = line.match(/^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)/);
    if (match && !match[2]) values[match[1]] = Number(match[3]);
  }
  return values;
}

async function pollMetrics() {
  const dot = $("live-dot");
  try {
    const response = await fetch("metrics");
    if (!response.ok) throw new Error(String(response.status));
    const m = parseMetrics(await response.text());
    const now = performance.now();
    $("live-running").textContent = fmt(m.blockspec_requests_running, 0);
    $("live-waiting").textContent = fmt(m.blockspec_requests_waiting, 0);
    const kv = m.blockspec_kv_cache_usage_perc;
    $("live-kv").textContent = kv == null ? "–" : `${(100 * kv).toFixed(1)}%`;
    $("live-kv-bar").style.width = `${Math.min(100, 100 * (kv || 0))}%`;
    const generated = m.blockspec_generation_tokens_total;
    if (state.lastMetrics && generated != null) {
      const rate = (generated - state.lastMetrics.generated) / ((now - state.lastMetrics.time) / 1000);
      $("live-rate").textContent = fmt(Math.max(0, rate), 1);
    }
    state.lastMetrics = { time: now, generated };
    const drafts = m.blockspec_spec_draft_tokens_total;
    $("live-acceptance").textContent = drafts ? `${(100 * m.blockspec_spec_accepted_tokens_total / drafts).toFixed(1)}%` : "–";
    dot.classList.add("on");
  } catch (error) {
    dot.classList.remove("on");
  }
}

function fmt(value, digits) {
  return value == null || Number.isNaN(value) ? "–" : value.toFixed(digits);
}

// ---- one answer: its cycles as they stream in ----------------------------------------------

class Answer {
  constructor() {
    this.element = appendMessage("assistant", "");
    this.body = this.element.querySelector(".body");
    this.element.dataset.state = "streaming";
    this.body.classList.add("cursor");
    this.text = "";
    this.cycles = [];          // the spec_cycles entries, in order
    this.started = performance.now();
    this.firstTokenAt = null;
    this.endedAt = null;
  }

  addChunk(chunk) {
    const choice = (chunk.choices || [])[0];
    const delta = (choice && choice.delta) || {};
    const content = (delta.reasoning_content || "") + (delta.content || "");
    let covered = "";
    for (const entry of chunk.spec_cycles || []) {
      this.addCycle(entry);
      covered += entry.text.join("");
    }
    // Text no token accounts for (released at the end of the output): shown plain.
    const rest = content.startsWith(covered) ? content.slice(covered.length) : content;
    if (rest) this.appendPlain(rest);
    this.text += content;
    if (content && this.firstTokenAt === null) this.firstTokenAt = performance.now();
    if (choice && choice.finish_reason) this.element.dataset.finishReason = choice.finish_reason;
    if (chunk.meta_info) this.element.dataset.metaInfo = JSON.stringify(chunk.meta_info);
    if (chunk.usage) this.element.dataset.completionTokens = String(chunk.usage.completion_tokens);
    scrollToEnd();
  }

  addCycle(entry) {
    this.cycles.push(entry);
    const group = document.createElement("span");
    group.className = entry.cycle === 0 ? "cycle prefill" : "cycle";
    group.dataset.cycle = String(entry.cycle);
    group.dataset.tokens = String(entry.tokens);
    group.dataset.accepted = String(entry.accepted);
    group.dataset.drafts = String(entry.drafts);
    if (entry.cycle !== 0) group.style.backgroundColor = cycleColour(entry.accepted);
    group.title = entry.cycle === 0
      ? "the first token, from the prefill"
      : `cycle ${entry.cycle}: ${entry.accepted} of ${entry.drafts} drafts accepted, then the bonus token`;
    entry.text.forEach((text, i) => {
      const token = document.createElement("span");
      // plain decoding has no drafts, so no bonus token to tell apart
      token.className = i === entry.bonus && state.speculative ? "tok bonus" : "tok";
      token.textContent = text;
      group.append(token);
    });
    this.body.append(group);
  }

  appendPlain(text) {
    const span = document.createElement("span");
    span.className = "plain";
    span.textContent = text;
    this.body.append(span);
  }

  end(how) {
    this.endedAt = performance.now();
    this.element.dataset.state = how;
    this.body.classList.remove("cursor");
    const reason = this.element.dataset.finishReason;
    const label = { done: reason ? `finished: ${reason}` : "finished", stopped: "stopped", error: "error" }[how];
    this.element.querySelector(".state").textContent = label;
    showStats(this);
  }
}

function showStats(answer) {
  const verify = answer.cycles.filter((c) => c.cycle > 0);
  const tokens = answer.cycles.reduce((n, c) => n + c.tokens, 0);
  const accepted = verify.reduce((n, c) => n + c.accepted, 0);
  const drafts = verify.reduce((n, c) => n + c.drafts, 0);
  const end = answer.endedAt || performance.now();
  // Decode speed: the tokens after the first over the time since the first (llama.cpp's way).
  const decodeS = answer.firstTokenAt === null ? 0 : (end - answer.firstTokenAt) / 1000;
  const rate = decodeS > 0.001 && tokens > 1 ? (tokens - 1) / decodeS : tokens / Math.max(0.001, (end - answer.started) / 1000);
  $("answer-stats").hidden = false;
  $("stat-rate").textContent = tokens ? rate.toFixed(1) : "–";
  $("stat-tau").textContent = verify.length ? (verify.reduce((n, c) => n + c.tokens, 0) / verify.length).toFixed(2) : "–";
  $("stat-rate-accepted").textContent = drafts ? `${(100 * accepted / drafts).toFixed(0)}%` : "–";
  $("stat-tokens").textContent = String(tokens);
  $("histogram-box").hidden = !state.speculative;
  drawHistogram(verify);
}

function drawHistogram(verify) {
  const counts = new Array(maxAccepted() + 1).fill(0);
  for (const c of verify) {
    while (counts.length <= c.accepted) counts.push(0);
    counts[c.accepted] += 1;
  }
  const top = Math.max(1, ...counts);
  const histogram = $("histogram");
  histogram.textContent = "";
  counts.forEach((count, accepted) => {
    const column = document.createElement("div");
    column.className = "col";
    column.dataset.accepted = String(accepted);
    column.dataset.count = String(count);
    column.title = `${count} cycle${count === 1 ? "" : "s"} accepted ${accepted} draft${accepted === 1 ? "" : "s"}`;
    const bar = document.createElement("div");
    bar.className = "hbar";
    bar.style.height = `${Math.round(44 * count / top)}px`;
    bar.style.backgroundColor = cycleColour(accepted);
    const label = document.createElement("div");
    label.className = "hlabel";
    label.textContent = String(accepted);
    column.append(bar, label);
    histogram.append(column);
  });
}

// ---- the conversation --------------------------------------------------------------------------

function appendMessage(role, text, images = []) {
  $("empty-hint").hidden = true;
  const message = document.createElement("div");
  message.className = `message ${role}`;
  const who = document.createElement("div");
  who.className = "who";
  const name = document.createElement("span");
  name.textContent = role;
  const stateLabel = document.createElement("span");
  stateLabel.className = "state";
  who.append(name, stateLabel);
  const body = document.createElement("div");
  body.className = "body";
  body.textContent = text;
  message.append(who);
  if (images.length) {
    const strip = document.createElement("div");
    strip.className = "images";
    for (const url of images) {
      const image = document.createElement("img");
      image.src = url;
      image.alt = "attached image";
      strip.append(image);
    }
    message.append(strip);
  }
  message.append(body);
  $("transcript").append(message);
  scrollToEnd();
  return message;
}

function scrollToEnd() {
  const transcript = $("transcript");
  transcript.scrollTop = transcript.scrollHeight;
}

function requestBody(messages) {
  return {
    messages,
    stream: true,
    stream_options: { include_usage: true, include_spec_cycles: true },
    return_meta_info: true,
    temperature: Number($("temperature").value),
    top_p: Number($("top-p").value),
    max_tokens: Number($("max-tokens").value),
  };
}

function headers() {
  const result = { "Content-Type": "application/json" };
  const key = $("api-key").value || sessionStorage.getItem(KEY_STORAGE);
  if (key) result.Authorization = `Bearer ${key}`;
  return result;
}

function showError(message) {
  $("error").hidden = !message;
  $("error").textContent = message || "";
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || `HTTP ${response.status}`;
  } catch (error) {
    return `HTTP ${response.status}`;
  }
}

// ---- images: attached from a file or pasted, sent as image_url parts (data: URLs) ------------

function readAsDataURL(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function attachFiles(files) {
  for (const file of files) {
    if (file.type.startsWith("image/")) state.images.push(await readAsDataURL(file));
  }
  showAttachments();
}

function showAttachments() {
  const box = $("attachments");
  box.replaceChildren();
  state.images.forEach((url, index) => {
    const image = document.createElement("img");
    image.src = url;
    image.alt = "attached image";
    image.title = "click to remove";
    image.addEventListener("click", () => { state.images.splice(index, 1); showAttachments(); });
    box.append(image);
  });
  box.hidden = state.images.length === 0;
}

function userContent(text, images) {
  if (!images.length) return text;
  return [...images.map((url) => ({ type: "image_url", image_url: { url } })), { type: "text", text }];
}

async function send(text) {
  showError("");
  const images = state.images;
  state.images = [];
  showAttachments();
  const content = userContent(text, images);
  const messages = [];
  const system = $("system-prompt").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...state.history, { role: "user", content });
  appendMessage("user", text, images);
  const answer = new Answer();
  state.controller = new AbortController();
  setStreaming(true);
  let how = "done";
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody(messages)), signal: state.controller.signal,
    });
    if (response.status === 401) {
      $("api-key-row").hidden = false;
      $("api-key").focus();
      throw new Error("This server needs an API key: enter it under Settings and send again.");
    }
    if (!response.ok) throw new Error(await errorMessage(response));
    await readEvents(response, answer);
  } catch (error) {
    if (error.name === "AbortError") {
      how = "stopped";
    } else {
      how = "error";
      showError(error.message);
    }
  } finally {
    answer.end(how);
    setStreaming(false);
    state.controller = null;
  }
  if (how !== "error") state.history.push({ role: "user", content }, { role: "assistant", content: answer.text });
}

async function readEvents(response, answer) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const payload = line.slice(6);
        if (payload === "[DONE]") return;
        const chunk = JSON.parse(payload);
        if (chunk.error) throw new Error(chunk.error.message);
        answer.addChunk(chunk);
        showStats(answer);
      }
    }
  }
}

function setStreaming(streaming) {
  $("send").disabled = streaming;
  $("stop").disabled = !streaming;
}

function stop() {
  if (state.controller) state.controller.abort();
}

function clear() {
  stop();
  state.history = [];
  state.images = [];
  showAttachments();
  for (const message of document.querySelectorAll("#transcript .message")) message.remove();
  $("empty-hint").hidden = false;
  $("answer-stats").hidden = true;
  showError("");
}

// ---- wiring --------------------------------------------------------------------------------

function bindSlider(id) {
  const input = $(id);
  const output = $(`${id}-value`);
  const update = () => { output.textContent = input.value; };
  input.addEventListener("input", update);
  update();
}

function init() {
  bindSlider("temperature");
  bindSlider("top-p");
  const key = sessionStorage.getItem(KEY_STORAGE);
  if (key) { $("api-key").value = key; $("api-key-row").hidden = false; }
  $("api-key").addEventListener("change", () => sessionStorage.setItem(KEY_STORAGE, $("api-key").value));
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value;
    if ((!text.trim() && !state.images.length) || state.controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("attach").addEventListener("click", () => $("image-file").click());
  $("image-file").addEventListener("change", async (event) => {
    await attachFiles(event.target.files);
    event.target.value = "";
  });
  $("prompt").addEventListener("paste", (event) => {
    const items = Array.from(event.clipboardData ? event.clipboardData.items : []);
    const files = items.filter((item) => item.kind === "file").map((item) => item.getAsFile()).filter(Boolean);
    if (files.length) attachFiles(files);
  });
  $("stop").addEventListener("click", stop);
  document.addEventListener("keydown", (event) => { if (event.key === "Escape") stop(); });
  $("clear").addEventListener("click", clear);
  buildLegend();
  loadHealth();
  pollMetrics();
  setInterval(pollMetrics, 1000);
}

document.addEventListener("DOMContentLoaded", init);
