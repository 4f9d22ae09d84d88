// The status page: scrape /metrics every second, show the figures and chart their history.
import uPlot from "../vendor/uPlot.esm.js";
import { ApiError, apiFetch } from "./api.js";
import { askForKey } from "./keyprompt.js";
import { bucketDelta, buckets, histogramQuantile, parsePrometheus, sum } from "./metrics.js";

const POINTS = 120; // two minutes of history
const WINDOW = 10; // percentiles over the last ten scrapes, so one slow request does not vanish at once
const P = "servelm:";
const TIMEOUT_MS = 5000; // a scrape not answered by then: the server is not answering
const KEY_RETRY_MS = 5000; // after the key dialog was cancelled: how often to see whether /metrics still needs one
// Counters that only grow while the server runs: one that went down means a restart.
const COUNTERS = [`${P}generation_tokens_total`, `${P}http_requests_total`, `${P}time_to_first_token_seconds_count`];

const charts = [
  { id: "chart-tokens", series: [["output tokens/s", "#2f7ed8"]] },
  { id: "chart-requests", series: [["running", "#2f7ed8"], ["waiting", "#e4572e"]] },
  { id: "chart-cache", series: [["KV cache used %", "#2f7ed8"], ["prefix-cache hits %", "#17a589"]] },
  { id: "chart-ttft", series: [["TTFT p50 ms", "#2f7ed8"], ["TTFT p95 ms", "#e4572e"]] },
  { id: "chart-itl", series: [["ITL p50 ms", "#2f7ed8"], ["ITL p95 ms", "#e4572e"]] },
  { id: "chart-rejected", series: [["429 rejections/s", "#e4572e"]] },
];
const history = []; // recent scrapes of the running server process: {t, samples}
export const columns = charts.map((c) => [[], ...c.series.map(() => [])]); // the charts' data (exported for the tests)
const keyButton = document.getElementById("key-button");
let declined = false; // the key dialog was cancelled: ask again only from the key button
let timer = 0;
let scraping = false; // a scrape is under way (it schedules the next one when it ends)

function makeChart(chart) {
  const el = document.getElementById(chart.id);
  const opts = {
    width: el.clientWidth || 300,
    height: 160,
    series: [{}, ...chart.series.map(([label, stroke]) => ({ label, stroke, width: 2, spanGaps: false }))],
    axes: [{}, { size: 50 }],
    scales: { y: { range: (_u, _min, max) => [0, max > 0 ? max * 1.1 : 1] } },
  };
  return new uPlot(opts, columns[charts.indexOf(chart)], el);
}

const plots = charts.map(makeChart);
window.addEventListener("resize", () =>
  plots.forEach((plot, i) => plot.setSize({ width: document.getElementById(charts[i].id).clientWidth, height: 160 })),
);

const fmt = (v, digits = 1) => (v == null || Number.isNaN(v) ? "–" : v.toFixed(digits));
const ms = (seconds) => (seconds == null ? null : seconds * 1000);

function show(id, text) {
  document.getElementById(id).textContent = text;
}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i += 1;
  }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function duration(seconds) {
  const s = Math.floor(seconds);
  const [d, h, m] = [Math.floor(s / 86400), Math.floor((s % 86400) / 3600), Math.floor((s % 3600) / 60)];
  return d ? `${d}d ${h}h ${m}m` : h ? `${h}h ${m}m ${s % 60}s` : `${m}m ${s % 60}s`;
}

/** The figures of one scrape, given the previous one and the oldest in the window. */
function figures(now, previous, oldest) {
  const s = now.samples;
  const dt = previous ? (now.t - previous.t) / 1000 : 0;
  const rate = (name, match) => (previous && dt > 0 ? (sum(s, name, match) - sum(previous.samples, name, match)) / dt : null);
  // Over the window only: a live page shows what happens now, not since the server started.
  const quantile = (name, q) =>
    oldest ? histogramQuantile(q, bucketDelta(buckets(s, name), buckets(oldest.samples, name))) : null;
  // Engine figures: the series without a `replica` label (this process's engine, or the sum over Ray replicas).
  const engine = (name) => sum(s, name, { replica: undefined });
  const queries = engine(`${P}prefix_cache_queries_total`);
  return {
    tokensPerSecond: rate(`${P}generation_tokens_total`),
    running: engine(`${P}num_requests_running`),
    waiting: engine(`${P}num_requests_waiting`),
    kvUsage: 100 * engine(`${P}kv_cache_usage_perc`),
    prefixHitRate: queries > 0 ? (100 * engine(`${P}prefix_cache_hits_total`)) / queries : null,
    ttft: [ms(quantile(`${P}time_to_first_token_seconds`, 0.5)), ms(quantile(`${P}time_to_first_token_seconds`, 0.95))],
    itl: [ms(quantile(`${P}inter_token_latency_seconds`, 0.5)), ms(quantile(`${P}inter_token_latency_seconds`, 0.95))],
    rejectedPerSecond: rate(`${P}http_requests_total`, { status: "429" }),
    rejectedTotal: sum(s, `${P}http_requests_total`, { status: "429" }),
  };
}

function update(f, samples) {
  const engine = (name) => sum(samples, name, { replica: undefined });
  const info = (samples.get(`${P}model_info`) || []).find((x) => x.labels.replica === undefined)?.labels;
  show("model", info?.model_name ?? "–");
  show("dtype", info?.dtype ?? "–");
  show("device", info?.device ?? "–");
  const tokens = engine(`${P}kv_cache_size_tokens`);
  show("kv-size", tokens ? `${tokens.toLocaleString()} tokens (${bytes(engine(`${P}kv_cache_size_bytes`))})` : "–");
  show("uptime", duration(sum(samples, `${P}uptime_seconds`)));
  show("v-tokens", fmt(f.tokensPerSecond));
  show("v-running", String(f.running));
  show("v-waiting", String(f.waiting));
  show("v-kv", `${fmt(f.kvUsage)} %`);
  show("v-prefix", f.prefixHitRate == null ? "–" : `${fmt(f.prefixHitRate)} %`);
  show("v-ttft", `${fmt(f.ttft[0], 0)} / ${fmt(f.ttft[1], 0)} ms`);
  show("v-itl", `${fmt(f.itl[0], 0)} / ${fmt(f.itl[1], 0)} ms`);
  show("v-rejected", String(f.rejectedTotal));
  plot([[f.tokensPerSecond], [f.running, f.waiting], [f.kvUsage, f.prefixHitRate], f.ttft, f.itl, [f.rejectedPerSecond]]);
}

/** Add one point to each chart: `rows[i]` holds chart i's values (null for a gap). */
function plot(rows) {
  const t = Date.now() / 1000;
  rows.forEach((values, i) => {
    const cols = columns[i];
    cols[0].push(t);
    values.forEach((v, j) => cols[j + 1].push(v));
    if (cols[0].length > POINTS) cols.forEach((c) => c.shift());
    plots[i].setData(cols);
  });
}

/** Whether the server restarted between two scrapes: its uptime or a counter went down. */
function restarted(now, before) {
  const down = (name) => sum(now.samples, name) < sum(before.samples, name);
  return down(`${P}uptime_seconds`) || COUNTERS.some(down);
}

function schedule(ms) {
  clearTimeout(timer);
  timer = setTimeout(scrape, ms);
}

async function scrape() {
  scraping = true;
  let next = 1000;
  try {
    const response = await apiFetch("/metrics", { signal: AbortSignal.timeout(TIMEOUT_MS) });
    const now = { t: Date.now(), samples: parsePrometheus(await response.text()) };
    // After a restart the counters start again from 0: so do the rates and windows, rather than go negative.
    if (history.length && restarted(now, history.at(-1))) history.length = 0;
    const previous = history.at(-1);
    history.push(now);
    if (history.length > WINDOW + 1) history.shift();
    update(figures(now, previous, history.length > 1 ? history[0] : null), now.samples);
    show("state", "live");
    declined = false;
    keyButton.hidden = true;
    document.body.dataset.scrapes = String(Number(document.body.dataset.scrapes || 0) + 1);
  } catch (err) {
    plot(charts.map((c) => c.series.map(() => null))); // a gap: no line drawn across the outage
    if (err?.name === "TimeoutError") show("state", `the server is not answering (no reply in ${TIMEOUT_MS / 1000} s)`);
    else if (err instanceof ApiError) show("state", `error ${err.status}: ${err.message}`);
    else show("state", `cannot reach the server (${err.message})`);
    if (err instanceof ApiError && err.status === 401) {
      keyButton.hidden = false;
      if (!declined) declined = !(await askForKey(`/metrics needs the API key: ${err.message}`));
      if (declined) next = KEY_RETRY_MS; // still checked, in case the server stops asking for a key
    }
  }
  scraping = false;
  schedule(next);
}

keyButton.addEventListener("click", async () => {
  if (!(await askForKey("/metrics needs the API key."))) return;
  declined = false;
  if (!scraping) schedule(0); // a scrape under way schedules the next one itself
});
scrape();
