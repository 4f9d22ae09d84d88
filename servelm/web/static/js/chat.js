// The chat page: conversation state in localStorage, streaming replies, stop, regenerate.
import { ApiError, apiFetch, streamChat, tokensPerSecond } from "./api.js";
import { askForKey } from "./keyprompt.js";
import { renderInto } from "./render.js";

const STORAGE = "servelm.chat";
const $ = (id) => document.getElementById(id);
const ui = {
  log: $("log"), form: $("composer"), message: $("message"), send: $("send"), stop: $("stop"),
  model: $("model"), system: $("system"), temperature: $("temperature"), topP: $("top-p"),
  maxTokens: $("max-tokens"), newChat: $("new-chat"),
};

// messages: {role: "user"|"assistant"|"error", content, stats?}; errors are shown, never sent.
let state = load();
let controller = null;

function load() {
  try {
    const saved = JSON.parse(localStorage.getItem(STORAGE));
    if (saved && Array.isArray(saved.messages)) return saved;
  } catch {
    // a corrupt entry: start afresh
  }
  return { messages: [], settings: {} };
}

function save() {
  state.settings = {
    model: ui.model.value, system: ui.system.value, temperature: ui.temperature.value,
    topP: ui.topP.value, maxTokens: ui.maxTokens.value,
  };
  localStorage.setItem(STORAGE, JSON.stringify(state));
}

function restoreSettings() {
  const s = state.settings || {};
  if (s.system !== undefined) ui.system.value = s.system;
  if (s.temperature !== undefined) ui.temperature.value = s.temperature;
  if (s.topP !== undefined) ui.topP.value = s.topP;
  if (s.maxTokens !== undefined) ui.maxTokens.value = s.maxTokens;
}

function statsText(stats) {
  if (!stats) return "";
  const parts = [];
  if (stats.ttft != null) parts.push(`TTFT ${(stats.ttft * 1000).toFixed(0)} ms`);
  if (stats.tokensPerSecond != null) parts.push(`${stats.tokensPerSecond.toFixed(1)} tokens/s`);
  if (stats.tokens != null) parts.push(`${stats.approximate ? "~" : ""}${stats.tokens} tokens`);
  if (stats.stopped) parts.push("stopped");
  else if (stats.finishReason === "length") parts.push("cut at max_tokens");
  return parts.join(" · ");
}

function button(label, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = label;
  b.addEventListener("click", onClick);
  return b;
}

/** The DOM of one message; returns its content element (to update while streaming). */
function renderMessage(msg, index) {
  const item = document.createElement("article");
  item.className = `msg ${msg.role}`;
  const content = document.createElement("div");
  content.className = "content";
  if (msg.role === "assistant") renderInto(content, msg.content);
  else content.textContent = msg.content; // user text and errors are never parsed as HTML
  item.append(content);
  if (msg.role === "assistant") {
    const footer = document.createElement("footer");
    const stats = document.createElement("span");
    stats.className = "stats";
    stats.textContent = statsText(msg.stats);
    footer.append(stats, button("Copy", () => copy(msg.content)));
    if (index === state.messages.length - 1 && !controller) footer.append(button("Regenerate", regenerate));
    item.append(footer);
  }
  ui.log.append(item);
  return content;
}

function redraw() {
  ui.log.replaceChildren();
  state.messages.forEach(renderMessage);
  ui.log.scrollTop = ui.log.scrollHeight;
}

async function copy(text) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    addError("Could not copy: the browser refused clipboard access.");
  }
}

function addError(text) {
  state.messages.push({ role: "error", content: text });
  save();
  redraw();
}

function describe(err) {
  if (err instanceof ApiError) {
    if (err.status === 429) {
      return `Too many requests (429): ${err.message}${err.retryAfter ? ` Retry after ${err.retryAfter} s.` : ""}`;
    }
    return `Error ${err.status}: ${err.message}`;
  }
  return `Network error: could not reach the server (${err.message}).`;
}

function setBusy(busy) {
  ui.send.disabled = busy;
  ui.stop.disabled = !busy;
}

function requestBody() {
  const messages = [];
  if (ui.system.value.trim()) messages.push({ role: "system", content: ui.system.value });
  for (const m of state.messages) if (m.role !== "error") messages.push({ role: m.role, content: m.content });
  const body = { model: ui.model.value, messages };
  const number = (el) => (el.value.trim() === "" ? undefined : Number(el.value));
  if (number(ui.temperature) !== undefined) body.temperature = number(ui.temperature);
  if (number(ui.topP) !== undefined) body.top_p = number(ui.topP);
  if (number(ui.maxTokens) !== undefined) body.max_tokens = number(ui.maxTokens);
  return body;
}

/** Stream a reply to the conversation as it stands. */
async function generate() {
  const body = requestBody();
  const reply = { role: "assistant", content: "" };
  state.messages.push(reply);
  controller = new AbortController();
  setBusy(true);
  redraw();
  const content = ui.log.lastElementChild.querySelector(".content");
  let frame = 0;
  try {
    const result = await streamChat(body, {
      signal: controller.signal,
      onText: (text) => {
        reply.content = text;
        // One render per frame: re-rendering the markdown on every token would fall behind.
        frame ||= requestAnimationFrame(() => {
          frame = 0;
          renderInto(content, reply.content);
          ui.log.scrollTop = ui.log.scrollHeight;
        });
      },
    });
    reply.content = result.text;
    const tokens = result.usage?.completion_tokens ?? result.chunks;
    reply.stats = {
      ttft: result.ttft, tokens, approximate: !result.usage, stopped: result.stopped,
      finishReason: result.finishReason, tokensPerSecond: tokensPerSecond(tokens, result.seconds),
    };
  } catch (err) {
    state.messages.pop(); // no reply: show why instead
    state.messages.push({ role: "error", content: describe(err) });
    if (err instanceof ApiError && err.status === 401) needKey(err.message, true);
  } finally {
    cancelAnimationFrame(frame);
    controller = null;
    setBusy(false);
    save();
    redraw();
  }
}

async function needKey(message, retry) {
  if (!(await askForKey(`The server needs an API key: ${message}`))) return;
  await loadModels();
  if (retry && state.messages.at(-1)?.role === "error") {
    state.messages.pop();
    save();
    generate();
  }
}

function send() {
  const text = ui.message.value;
  if (!text.trim() || controller) return;
  state.messages.push({ role: "user", content: text });
  ui.message.value = "";
  generate();
}

function regenerate() {
  if (controller) return;
  while (state.messages.length && state.messages.at(-1).role !== "user") state.messages.pop();
  if (state.messages.length) generate();
}

async function loadModels() {
  try {
    const response = await apiFetch("/v1/models");
    const { data } = await response.json();
    // The server lists its chat model first; an embedding model answers chat with a clear 400.
    ui.model.replaceChildren(...data.map((m) => new Option(m.id, m.id)));
    if (data.some((m) => m.id === state.settings?.model)) ui.model.value = state.settings.model;
  } catch (err) {
    if (err instanceof ApiError && err.status === 401) needKey(err.message, false);
    else addError(`Could not list the models. ${describe(err)}`);
  }
}

ui.form.addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});
ui.message.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  }
});
ui.stop.addEventListener("click", () => controller?.abort());
ui.newChat.addEventListener("click", () => {
  controller?.abort();
  state.messages = [];
  save();
  redraw();
  ui.message.focus();
});
for (const el of [ui.model, ui.system, ui.temperature, ui.topP, ui.maxTokens]) el.addEventListener("change", save);

restoreSettings();
redraw();
loadModels();
