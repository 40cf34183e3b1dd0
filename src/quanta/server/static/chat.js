// The chat page: sends the conversation to /v1/chat/completions with stream=true, renders the streamed answer
// as Markdown, Stop aborts the request (the server then aborts its generation), New chat forgets the history.
// Tokens/s per answer: completion tokens (from the usage chunk) over the time from first to last token.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { history: [], controller: null, model: "quanta", epoch: 0 };

function settings() {
  const key = $("api-key").value.trim();
  localStorage.setItem("quanta.system", $("system-prompt").value);
  localStorage.setItem("quanta.temperature", $("temperature").value);
  localStorage.setItem("quanta.maxTokens", $("max-tokens").value);
  return {
    system: $("system-prompt").value.trim(),
    temperature: Number($("temperature").value),
    maxTokens: Math.max(1, Number($("max-tokens").value) || 512),
    headers: { "Content-Type": "application/json", ...(key ? { Authorization: `Bearer ${key}` } : {}) },
  };
}

function bubble(role, text) {
  $("empty-hint")?.remove();
  const el = document.createElement("div");
  el.className = `message ${role}`;
  el.innerHTML = `<div class="role">${role}</div><div class="content"></div><div class="stats"></div>`;
  if (role === "user") el.querySelector(".content").textContent = text;
  $("conversation").appendChild(el);
  el.scrollIntoView({ block: "end" });
  return el;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return body.error?.message || `HTTP ${response.status}`;
  } catch {
    return `HTTP ${response.status}`;
  }
}

// Yields each SSE event's data (a string) from a fetch response body.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (data) yield data;
    }
  }
}

async function send(text) {
  const opts = settings();
  const epoch = state.epoch;
  state.history.push({ role: "user", content: text });
  bubble("user", text);
  const el = bubble("assistant", "");
  el.classList.add("streaming");
  const content = el.querySelector(".content");
  const stats = el.querySelector(".stats");
  const messages = (opts.system ? [{ role: "system", content: opts.system }] : []).concat(state.history);
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  let answer = "", pieces = 0, first = 0, last = 0, usage = null, ended = "stopped";
  let pending = false;
  const paint = () => {
    pending = false;
    content.innerHTML = Markdown.render(answer);
    el.scrollIntoView({ block: "end" });
  };
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: opts.headers, signal: controller.signal,
      body: JSON.stringify({ model: state.model, messages, stream: true, stream_options: { include_usage: true },
                             temperature: opts.temperature, max_tokens: opts.maxTokens }),
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const data of events(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices?.[0];
      if (!choice) continue;
      if (choice.finish_reason) ended = choice.finish_reason;
      const delta = choice.delta?.content;
      if (delta) {
        last = performance.now();
        if (!first) first = last;
        pieces += 1;
        answer += delta;
        if (!pending) { pending = true; requestAnimationFrame(paint); }
      }
    }
  } catch (e) {
    if (e.name !== "AbortError") {
      el.classList.add("error");
      stats.textContent = `error: ${e.message}`;
    }
  } finally {
    state.controller = null;
    setBusy(false);
    el.classList.remove("streaming");
    paint();
  }
  if (!el.classList.contains("error")) {
    const tokens = usage ? usage.completion_tokens : pieces;
    const seconds = (last - first) / 1000;
    const rate = tokens > 1 && seconds > 0 ? ((tokens - 1) / seconds).toFixed(1) : "–";
    stats.textContent = `${tokens} tokens · ${rate} tok/s · ${ended}`;
  }
  if (epoch === state.epoch) state.history.push({ role: "assistant", content: answer });
}

function newChat() {
  state.controller?.abort();
  state.epoch += 1;
  state.history = [];
  $("conversation").innerHTML = '<p id="empty-hint" class="muted">New chat. Ask anything.</p>';
  $("prompt").focus();
}

async function loadModelName() {
  try {
    const response = await fetch("/v1/models", { headers: settings().headers });
    if (response.ok) {
      state.model = (await response.json()).data[0].id;
      $("model-name").textContent = state.model;
    }
  } catch { /* the page still works with the default name */ }
}

function init() {
  $("system-prompt").value = localStorage.getItem("quanta.system") || "";
  $("temperature").value = localStorage.getItem("quanta.temperature") || "0.7";
  $("max-tokens").value = localStorage.getItem("quanta.maxTokens") || "512";
  $("temperature-value").textContent = $("temperature").value;
  $("temperature").addEventListener("input", () => { $("temperature-value").textContent = $("temperature").value; });
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || state.controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
  });
  $("stop").addEventListener("click", () => state.controller?.abort());
  $("new-chat").addEventListener("click", newChat);
  $("api-key").addEventListener("change", loadModelName);
  loadModelName();
}

init();
