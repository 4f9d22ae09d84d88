// Reading the server's Prometheus text (/metrics) in the browser: parse, sum, rates, quantiles.

const LINE = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/;
const LABEL = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;
const unescape = (v) => v.replace(/\\(["\\n])/g, (_, c) => (c === "n" ? "\n" : c));

/** Prometheus text format -> Map of metric name -> [{labels, value}] (comments skipped). */
export function parsePrometheus(text) {
  const samples = new Map();
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = LINE.exec(line);
    if (!m) continue;
    const labels = {};
    for (const [, name, value] of (m[2] || "").matchAll(LABEL)) labels[name] = unescape(value);
    const value = Number(m[3] === "+Inf" ? Infinity : m[3] === "-Inf" ? -Infinity : m[3]);
    if (!samples.has(m[1])) samples.set(m[1], []);
    samples.get(m[1]).push({ labels, value });
  }
  return samples;
}

/** Sum of a metric's samples whose labels include `match`; 0 when there are none. */
export function sum(samples, name, match = {}) {
  let total = 0;
  for (const s of samples.get(name) || []) {
    if (Object.entries(match).every(([k, v]) => s.labels[k] === v)) total += s.value;
  }
  return total;
}

/** The labels of a metric's first sample, or null. */
export function labelsOf(samples, name) {
  return samples.get(name)?.[0]?.labels ?? null;
}

/** A histogram's cumulative buckets summed over label sets: [{le, count}] sorted by le. */
export function buckets(samples, name) {
  const byLe = new Map();
  for (const s of samples.get(`${name}_bucket`) || []) {
    const le = s.labels.le === "+Inf" ? Infinity : Number(s.labels.le);
    byLe.set(le, (byLe.get(le) || 0) + s.value);
  }
  return [...byLe].map(([le, count]) => ({ le, count })).sort((a, b) => a.le - b.le);
}

/**
 * The buckets observed between two scrapes (`after` minus `before`). A count that went down
 * means the server restarted in between: then all it observed since is `after` itself.
 */
export function bucketDelta(after, before) {
  const old = new Map(before.map((b) => [b.le, b.count]));
  if (after.some((b) => b.count < (old.get(b.le) || 0))) return after;
  return after.map((b) => ({ le: b.le, count: b.count - (old.get(b.le) || 0) }));
}

/**
 * The q-quantile of cumulative buckets, interpolated linearly inside the bucket
 * as Prometheus' histogram_quantile does; null when nothing was observed.
 */
export function histogramQuantile(q, cumulative) {
  const total = cumulative.length ? cumulative[cumulative.length - 1].count : 0;
  if (!(total > 0)) return null;
  const rank = q * total;
  let prevLe = 0;
  let prevCount = 0;
  for (const { le, count } of cumulative) {
    if (count >= rank) {
      if (le === Infinity) return prevLe; // the highest finite bound, as Prometheus does
      return prevLe + ((le - prevLe) * (rank - prevCount)) / (count - prevCount || 1);
    }
    prevLe = le;
    prevCount = count;
  }
  return prevLe;
}
