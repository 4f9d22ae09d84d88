// Calls to the server's OpenAI API from the pages: the key, errors, the chat stream.
import { SSEParser } from "./sse.js";

const KEY_STORAGE = "servelm.apiKey";

export function getApiKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

export function setApiKey(key) {
  if (key) localStorage.setItem(KEY_STORAGE, key);
  else localStorage.removeItem(KEY_STORAGE);
}

/** An HTTP error with the message of the server's OpenAI error body. */
export class ApiError extends Error {
  constructor(status, message, code = null, retryAfter = null, type = null) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.code = code;
    this.retryAfter = retryAfter;
    this.type = type;
  }
}

// The status docs/API.md gives each error type, for an error sent as an event in a stream
// (its HTTP status was already 200); null for a type not listed there.
const STATUS_OF_TYPE = {
  invalid_request_error: 400, timeout_error: 408, requests: 429, tokens: 429, server_overloaded: 429,
  server_error: 500, service_unavailable_error: 503,
};

/** The ApiError of an error event (`{"error": {...}}`) in a stream. */
function streamError({ message, type = null, code = null }) {
  return new ApiError(STATUS_OF_TYPE[type] ?? null, message, code, null, type);
}

async function errorOf(response) {
  let message = `HTTP ${response.status} ${response.statusText}`.trim();
  let code = null;
  let type = null;
  try {
    const body = await response.json();
    if (body?.error?.message) message = body.error.message;
    code = body?.error?.code ?? null;
    type = body?.error?.type ?? null;
  } catch {
    // not JSON: keep the status line
  }
  return new ApiError(response.status, message, code, response.headers.get("retry-after"), type);
}

/** fetch() with the stored key as a Bearer token; throws ApiError when the status is not 2xx. */
export async function apiFetch(path, init = {}, fetchFn = fetch) {
  const headers = new Headers(init.headers);
  const key = getApiKey();
  if (key) headers.set("Authorization", `Bearer ${key}`);
  const response = await fetchFn(path, { ...init, headers });
  if (!response.ok) throw await errorOf(response);
  return response;
}

/**
 * Stream one chat completion. `onText(text)` gets the reply so far after each delta.
 * Aborting `signal` stops reading and closes the connection, which the server takes
 * as a client disconnect and frees the request; the text so far is returned with
 * `stopped: true`. A failure after some text (an error event, a dropped connection)
 * returns the text so far with the error in `error`; a failure before any text throws.
 * Returns {text, stopped, error, finishReason, usage, ttft, seconds, chunks} (times in seconds).
 */
export async function streamChat(body, { signal, onText = () => {}, fetchFn = fetch, now = () => performance.now() } = {}) {
  const started = now();
  const result = { text: "", stopped: false, error: null, finishReason: null, usage: null, ttft: null, seconds: 0, chunks: 0 };
  let firstToken = null;
  try {
    const response = await apiFetch(
      "/v1/chat/completions",
      {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
        signal,
      },
      fetchFn,
    );
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    const parser = new SSEParser();
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      for (const data of parser.push(decoder.decode(value, { stream: true }))) {
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw streamError(chunk.error);
        if (chunk.usage) result.usage = chunk.usage;
        const choice = chunk.choices?.[0];
        if (choice?.finish_reason) result.finishReason = choice.finish_reason;
        const delta = choice?.delta?.content;
        if (delta) {
          firstToken ??= now();
          result.text += delta;
          result.chunks += 1;
          onText(result.text);
        }
      }
    }
  } catch (err) {
    if (err?.name === "AbortError") result.stopped = true;
    else if (result.text) result.error = err;
    else throw err;
  }
  const ended = now();
  if (firstToken !== null) {
    result.ttft = (firstToken - started) / 1000;
    result.seconds = (ended - firstToken) / 1000;
  }
  return result;
}

/** Tokens per second after the first token, or null when it cannot be told. */
export function tokensPerSecond(tokens, seconds) {
  return tokens > 1 && seconds > 0 ? (tokens - 1) / seconds : null;
}
