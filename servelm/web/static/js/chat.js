// The chat page: conversation state in localStorage, streaming replies, stop, regenerate.
import { ApiError, apiFetch, streamChat, tokensPerSecond } from "./api.js";
import { askForKey } from "./keyprompt.js";
import { renderInto } from "./render.js";

const STORAGE = "servelm.chat";
const $ = (id) => document.getElementById(id);
const ui = {
  log: $("log"), form: $("composer"), message: $("message"), send: $("send"), stop: $("stop"),
  model: $("model"), system: $("system"), temperature: $("temperature"), topP: $("top-p"),
  maxTokens: $("max-tokens"), newChat: $("new-chat"), note: $("note"),
};
const SAVE_EVERY_MS = 1000; // how often a streaming reply is saved, so a reload keeps it

// messages: {role: "user"|"assistant"|"error", content, stats?, streaming?}; errors are shown, never sent.
let state = load();
let controller = null;
let savedAt = 0;

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
  savedAt = performance.now();
  try {
    localStorage.setItem(STORAGE, JSON.stringify(state));
  } catch (err) {
    // Full (QuotaExceededError) or refused: the page works on, the conversation just is not kept.
    if (!ui.note.hidden) return;
    ui.note.textContent = `This conversation could not be saved in the browser (${err.name}); a reload will lose it.`;
    ui.note.hidden = false;
  }
}

/** After a reload: a reply that was streaming is marked stopped; a message left with no reply goes back to the composer. */
function recover() {
  state.messages = state.messages.filter((m) => !(m.streaming && !m.content));
  for (const m of state.messages.filter((m) => m.streaming)) {
    delete m.streaming;
    m.stats = { stopped: true };
  }
  if (state.messages.at(-1)?.role === "user") unsend(state.messages.length - 1);
}

/** Take back the user's message at `index` (it got no reply) and put its text in the composer, unless a new one is there. */
function unsend(index) {
  const [turn] = state.messages.splice(index, 1);
  if (!ui.message.value.trim()) ui.message.value = turn.content;
  return turn.content;
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
  else if (stats.error) parts.push(`cut short by ${stats.error}`);
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
    stats.className = msg.stats?.error ? "stats error" : "stats";
    stats.textContent = statsText(msg.stats);
    footer.append(stats, button("Copy", () => copy(msg.content)));
    if (index === state.messages.length - 1 && !controller) footer.append(button("Regenerate", regenerate));
    item.append(footer);
  }
  ui.log.append(item);
  return content;
}

/** Whether the conversation is scrolled to (near) its end, where new text should keep it. */
function atBottom() {
  return ui.log.scrollHeight - ui.log.scrollTop - ui.log.clientHeight < 40;
}

/** Draw the conversation again; scroll to its end unless `stick` is false (a reader who scrolled up). */
function redraw(stick = true) {
  const top = ui.log.scrollTop;
  ui.log.replaceChildren();
  state.messages.forEach(renderMessage);
  ui.log.scrollTop = stick ? ui.log.scrollHeight : top;
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
      // The rate limiter's message names the wait ("Please try again in 46.648s."): say it once.
      const wait = err.retryAfter && !/try again in/i.test(err.message) ? ` Retry after ${err.retryAfter} s.` : "";
      return `Too many requests (429): ${err.message.replace(/ ?Retry after the time in the Retry-After header\./, "")}${wait}`;
    }
    return `Error ${err.status ?? err.type}: ${err.message}`;
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
  // Saved as it streams, marked `streaming`, so a reload keeps it (as a stopped reply).
  const reply = { role: "assistant", content: "", streaming: true };
  state.messages.push(reply);
  controller = new AbortController();
  setBusy(true);
  save();
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
          const stick = atBottom(); // a reader who scrolled up stays where they are
          renderInto(content, reply.content);
          if (stick) ui.log.scrollTop = ui.log.scrollHeight;
          if (performance.now() - savedAt > SAVE_EVERY_MS) save();
        });
      },
    });
    reply.content = result.text;
    const tokens = result.usage?.completion_tokens ?? result.chunks;
    reply.stats = {
      ttft: result.ttft, tokens, approximate: !result.usage, stopped: result.stopped,
      error: result.error && describe(result.error), // the text so far is kept, with why it ended
      finishReason: result.finishReason, tokensPerSecond: tokensPerSecond(tokens, result.seconds),
    };
  } catch (err) {
    failed(reply, err);
  } finally {
    delete reply.streaming;
    cancelAnimationFrame(frame);
    controller = null;
    setBusy(false);
    save();
    redraw(atBottom());
  }
}

/**
 * A request that failed before any reply text: its user message is taken back into the
 * composer, so the conversation never keeps a message that got no reply (the next request
 * would carry it again), and the error is shown in its place.
 */
function failed(reply, err) {
  const index = state.messages.indexOf(reply);
  if (index < 0) return; // the conversation was cleared meanwhile
  state.messages.splice(index, 1);
  const text = state.messages[index - 1]?.role === "user" ? unsend(index - 1) : null;
  state.messages.push({ role: "error", content: describe(err) });
  if (err instanceof ApiError && err.status === 401) needKey(err.message, text);
}

/** Ask for the key; with it, send `retry` again if that text still waits in the composer. */
async function needKey(message, retry = null) {
  if (!(await askForKey(`The server needs an API key: ${message}`))) return;
  await loadModels();
  if (retry !== null && ui.message.value === retry && !controller) {
    if (state.messages.at(-1)?.role === "error") state.messages.pop();
    send();
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
// Leaving the page (reload, closed tab) stops the reply as Stop does and saves it at once: saving is
// otherwise throttled while it streams. beforeunload comes before the browser drops the stream
// (which would read as a network error); pagehide is the one some mobile browsers send.
for (const type of ["beforeunload", "pagehide"]) {
  window.addEventListener(type, () => {
    if (!controller) return;
    save();
    controller.abort();
  });
}

restoreSettings();
recover();
redraw();
loadModels();
