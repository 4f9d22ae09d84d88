// The status page: scrape /metrics every second, show the figures and chart their history.
import uPlot from "../vendor/uPlot.esm.js";
import { ApiError, apiFetch } from "./api.js";
import { askForKey } from "./keyprompt.js";
import { bucketDelta, buckets, histogramQuantile, parsePrometheus, sum } from "./metrics.js";

const POINTS = 120; // two minutes of history
const WINDOW = 10; // percentiles over the last ten scrapes, so one slow request does not vanish at once
const P = "servelm:";

const charts = [
  { id: "chart-tokens", series: [["output tokens/s", "#2f7ed8"]] },
  { id: "chart-requests", series: [["running", "#2f7ed8"], ["waiting", "#e4572e"]] },
  { id: "chart-cache", series: [["KV cache used %", "#2f7ed8"], ["prefix-cache hits %", "#17a589"]] },
  { id: "chart-ttft", series: [["TTFT p50 ms", "#2f7ed8"], ["TTFT p95 ms", "#e4572e"]] },
  { id: "chart-itl", series: [["ITL p50 ms", "#2f7ed8"], ["ITL p95 ms", "#e4572e"]] },
  { id: "chart-rejected", series: [["429 rejections/s", "#e4572e"]] },
];
const history = []; // recent scrapes: {t, samples}
const columns = charts.map((c) => [[], ...c.series.map(() => [])]);

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
  const rows = [[f.tokensPerSecond], [f.running, f.waiting], [f.kvUsage, f.prefixHitRate], f.ttft, f.itl, [f.rejectedPerSecond]];
  const t = Date.now() / 1000;
  rows.forEach((values, i) => {
    const cols = columns[i];
    cols[0].push(t);
    values.forEach((v, j) => cols[j + 1].push(v));
    if (cols[0].length > POINTS) cols.forEach((c) => c.shift());
    plots[i].setData(cols);
  });
}

async function scrape() {
  try {
    const response = await apiFetch("/metrics");
    const now = { t: Date.now(), samples: parsePrometheus(await response.text()) };
    const previous = history.at(-1);
    history.push(now);
    if (history.length > WINDOW + 1) history.shift();
    update(figures(now, previous, history.length > 1 ? history[0] : null), now.samples);
    show("state", "live");
    document.body.dataset.scrapes = String(Number(document.body.dataset.scrapes || 0) + 1);
  } catch (err) {
    show("state", err instanceof ApiError ? `error ${err.status}: ${err.message}` : `cannot reach the server (${err.message})`);
    if (err instanceof ApiError && err.status === 401) {
      await askForKey(`/metrics needs the API key: ${err.message}`);
    }
  }
  setTimeout(scrape, 1000);
}

scrape();
