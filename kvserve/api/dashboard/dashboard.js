// kvserve's live dashboard: polls GET /v1/stats once a second and draws what the cache is doing.
// No build step, no network beyond this server; charts by uPlot (vendored beside this file, MIT).
"use strict";

const POLL_MS = 1000;
const HISTORY = 300; // points kept per series: five minutes at one a second
const KEY_STORE = "kvserve-api-key";
const COLORS = { in_use: "#d9480f", pinned: "#7048e8", evictable: "#1c7ed6", free: "#ced4da",
                 computed: "#e8590c", exact: "#2f9e44", approx: "#f08c00", running: "#1c7ed6", waiting: "#e03131" };

const history = { t: [], in_use: [], pinned: [], evictable: [], free: [], computed: [], exact: [], approx: [],
                  hitNow: [], hitAll: [], running: [], waiting: [] };
let previous = null; // the last snapshot, for per-interval rates
let fields = null; // the declared numbers (GET /dashboard/fields.json): path, unit, help
const charts = {};

function $(id) { return document.getElementById(id); }
function fmtInt(n) { return Number(n).toLocaleString("en-US"); }
function fmtPct(x) { return x === null || x === undefined || Number.isNaN(x) ? "–" : (100 * x).toFixed(1) + " %"; }
function fmtSec(s) { return s < 1 ? (1000 * s).toFixed(0) + " ms" : s.toFixed(s < 10 ? 2 : 1) + " s"; }
function fmtAgo(s) { return s < 60 ? s.toFixed(0) + " s ago" : s < 3600 ? (s / 60).toFixed(0) + " min ago" : (s / 3600).toFixed(1) + " h ago"; }
function setText(id, text) { const el = $(id); if (el.textContent !== text) el.textContent = text; }

function apiKey() { return sessionStorage.getItem(KEY_STORE) || ""; }

async function fetchStats() {
  const headers = apiKey() ? { Authorization: "Bearer " + apiKey() } : {};
  const r = await fetch("/v1/stats", { headers, cache: "no-store" });
  if (r.status === 401) {
    const body = await r.json().catch(() => ({}));
    const err = new Error((body.error && body.error.message) || "unauthorized");
    err.unauthorized = true;
    throw err;
  }
  if (!r.ok) throw new Error("GET /v1/stats answered " + r.status);
  return r.json();
}

function showKeyForm(message) {
  $("key-form").hidden = false;
  $("board").hidden = true;
  setText("key-error", message || "");
  setText("status", "waiting for the API key");
}

function lineChart(el, series, opts = {}) {
  return new uPlot({
    width: el.clientWidth || 560, height: 220, legend: { live: false },
    scales: { x: { time: true }, y: opts.y || { auto: true } },
    axes: [{}, { values: opts.yValues, size: 60 }],
    series: [{}, ...series],
  }, [[], ...series.map(() => [])], el);
}

function histogramChart(el, bounds, color) {
  const labels = [...bounds.map((b) => "≤" + fmtSec(b)), ">" + fmtSec(bounds[bounds.length - 1])];
  const xs = labels.map((_, i) => i);
  const chart = new uPlot({
    width: el.clientWidth || 560, height: 220, legend: { live: false },
    scales: { x: { time: false, range: [-0.5, labels.length - 0.5] } },
    axes: [{ values: (u, ticks) => ticks.map((i) => labels[i] || ""), space: 40, rotate: -45, size: 60 },
           { size: 60 }],
    series: [{}, { label: "count", fill: color + "99", stroke: color, paths: uPlot.paths.bars({ size: [0.8, 60] }),
                   points: { show: false } }],
  }, [xs, xs.map(() => 0)], el);
  chart.xs = xs;
  return chart;
}

function makeCharts(stats) {
  const w = (id) => $(id);
  // stacked: each series is the running sum, drawn from the largest down so each fill sits on the next
  const layer = (label, key) => ({ label, stroke: COLORS[key], fill: COLORS[key] + "cc", width: 1,
    value: (u, v, si, i) => (i === null || i === undefined ? "–" : fmtInt(history[key][i] ?? 0)) });
  charts.pool = lineChart(w("chart-pool"), [layer("free", "free"), layer("evictable", "evictable"),
    layer("pinned", "pinned"), layer("in use", "in_use")]);
  charts.tokens = lineChart(w("chart-tokens"), [
    { label: "computed", stroke: COLORS.computed, width: 2 },
    { label: "reused exactly", stroke: COLORS.exact, width: 2 },
    { label: "reused approximately", stroke: COLORS.approx, width: 2 }]);
  charts.hits = lineChart(w("chart-hits"), [
    { label: "this interval", stroke: COLORS.exact, width: 2, spanGaps: false },
    { label: "since start", stroke: "#495057", width: 1, dash: [4, 4] }],
    { y: { range: [0, 1] }, yValues: (u, ticks) => ticks.map((t) => (100 * t).toFixed(0) + "%") });
  charts.queue = lineChart(w("chart-queue"), [
    { label: "running", stroke: COLORS.running, width: 2 },
    { label: "waiting", stroke: COLORS.waiting, width: 2 }]);
  const h = stats.latency.histograms;
  charts.ttft = histogramChart(w("chart-ttft"), h.ttft_s.bounds, "#1c7ed6");
  charts.itl = histogramChart(w("chart-itl"), h.inter_token_s.bounds, "#2f9e44");
}

function push(key, value) {
  history[key].push(value);
  if (history[key].length > HISTORY) history[key].shift();
}

function record(stats, now) {
  const c = stats.cache, occ = c.occupancy_blocks, tok = tokenTotals(stats);
  push("t", now / 1000);
  for (const k of ["in_use", "pinned", "evictable", "free"]) push(k, occ[k]);
  push("running", stats.queue.running);
  push("waiting", stats.queue.waiting);
  if (previous) {
    const dt = Math.max(1e-3, (now - previous.now) / 1000), was = previous.tok;
    push("computed", (tok.computed - was.computed) / dt);
    push("exact", (tok.exact - was.exact) / dt);
    push("approx", (tok.approx - was.approx) / dt);
    const queried = c.query_tokens - previous.query, hit = c.hit_tokens - previous.hit;
    push("hitNow", queried > 0 ? hit / queried : null);
  } else {
    for (const k of ["computed", "exact", "approx", "hitNow"]) push(k, null);
  }
  push("hitAll", c.query_tokens ? c.hit_rate : null);
  previous = { now, tok, query: c.query_tokens, hit: c.hit_tokens };
}

function tokenTotals(stats) {
  return { computed: stats.tokens.prompt_tokens_computed, exact: stats.cache.hit_tokens,
           approx: stats.cache.reuse.num_approx_hit_tokens };
}

function drawCharts(stats) {
  const t = history.t, sum = (...keys) => t.map((_, i) => keys.reduce((a, k) => a + history[k][i], 0));
  charts.pool.setData([t, sum("in_use", "pinned", "evictable", "free"), sum("in_use", "pinned", "evictable"),
                       sum("in_use", "pinned"), history.in_use.slice()]);
  charts.tokens.setData([t, history.computed.slice(), history.exact.slice(), history.approx.slice()]);
  charts.hits.setData([t, history.hitNow.slice(), history.hitAll.slice()]);
  charts.queue.setData([t, history.running.slice(), history.waiting.slice()]);
  const h = stats.latency.histograms;
  charts.ttft.setData([charts.ttft.xs, h.ttft_s.counts]);
  charts.itl.setData([charts.itl.xs, h.inter_token_s.counts]);
}

function fillRows(tbody, rows) {
  const html = rows.map((r) => "<tr>" + r.map((v) => "<td>" + v + "</td>").join("") + "</tr>").join("");
  if (tbody.dataset.html !== html) { tbody.innerHTML = html; tbody.dataset.html = html; }
}

function escapeText(s) {
  return String(s).replace(/[&<>"']/g, (ch) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[ch]);
}

function fmtValue(value, unit) {
  if (typeof value !== "number") return escapeText(value);
  if (unit === "ratio") return fmtPct(value);
  return Number.isInteger(value) ? fmtInt(value) : value.toFixed(3);
}

function drawAllNumbers(stats) {
  if (!fields) return;
  fillRows($("numbers").tBodies[0], fields.map((f) => {
    const [section, key] = f.path.split(".");
    return ["<code>" + escapeText(f.path) + "</code>", fmtValue(stats[section][key], f.unit), escapeText(f.unit),
            escapeText(f.help)];
  }));
}

function drawNumbers(stats) {
  const c = stats.cache, occ = c.occupancy_blocks, tok = tokenTotals(stats);
  setText("model", stats.model.id + " · " + c.codec + " KV");
  setText("running", fmtInt(stats.queue.running));
  setText("waiting", fmtInt(stats.queue.waiting));
  setText("hit-rate", c.query_tokens ? fmtPct(c.hit_rate) : "–");
  setText("hit-tokens", fmtInt(c.hit_tokens));
  setText("query-tokens", fmtInt(c.query_tokens));
  setText("tok-computed", fmtInt(tok.computed));
  setText("tok-exact", fmtInt(tok.exact));
  setText("tok-approx", fmtInt(tok.approx));
  for (const k of ["in_use", "pinned", "evictable", "free"]) setText("blocks-" + k, fmtInt(occ[k]));
  setText("chunks", fmtInt(c.chunks));
  setText("evictions", fmtInt(c.evictions));

  const total = tok.computed + tok.exact + tok.approx;
  const share = (n) => (total ? fmtPct(n / total) : "–");
  const sources = [["computed", tok.computed], ["reused exactly (the hot pool)", tok.exact],
                   ["reused approximately (content match)", tok.approx]].map(([name, n]) => [name, fmtInt(n), share(n)]);
  const chunkSize = stats.config.chunk_size;
  for (const [tier, row] of Object.entries(c.tiers || {})) {
    if (tier === "hot") continue;
    const n = row.loads * chunkSize;
    sources.push(["&nbsp;&nbsp;of those exactly, loaded from the " + escapeText(tier) + " tier", fmtInt(n), share(n)]);
  }
  fillRows($("sources").tBodies[0], sources);

  fillRows($("top-chunks").tBodies[0], c.top_chunks.map((r) => [
    "<code>" + escapeText(r.chunk_hash) + "</code>", fmtInt(r.prefix_tokens), fmtInt(r.num_tokens),
    fmtInt(r.num_hits), r.pinned ? "yes" : "no",
    escapeText(r.tier) + (r.origin === "computed" ? "" : " (from " + escapeText(r.origin) + ")"), fmtAgo(r.idle_s)]));
  if (c.top_chunks_withheld) fillRows($("top-chunks").tBodies[0], [["hidden: " + escapeText(c.top_chunks_withheld), "", "", "", "", "", ""]]);
  else if (!c.top_chunks.length) fillRows($("top-chunks").tBodies[0], [["nothing cached yet", "", "", "", "", "", ""]]);

  const audit = Object.entries(c.reuse.audit || {});
  fillRows($("audit").tBodies[0], audit.length ? audit.map(([name, a]) => [escapeText(name), fmtInt(a.num_audited),
    fmtPct(a.greedy_agreement), a.mean_kl_p50.toFixed(4), a.mean_kl_p95.toFixed(4), a.mean_kl_max.toFixed(4),
    a.kl_p50.toFixed(4), a.kl_max.toFixed(4)])
    : [["no audits yet (approximate reuse audits a sample of its requests)", "", "", "", "", "", "", ""]]);
}

async function poll() {
  try {
    const stats = await fetchStats();
    const now = Date.now();
    $("key-form").hidden = true;
    $("board").hidden = false;
    if (!charts.pool) makeCharts(stats);
    record(stats, now);
    if (!fields) fields = await fetch("/dashboard/fields.json", { cache: "no-store" }).then((r) => r.json());
    drawNumbers(stats);
    drawAllNumbers(stats);
    drawCharts(stats);
    setText("status", "live · updated " + new Date(now).toLocaleTimeString());
    document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
  } catch (e) {
    if (e.unauthorized) {
      showKeyForm(apiKey() ? e.message : "");
    } else {
      setText("status", "cannot reach the server: " + e.message + " (retrying)");
    }
  }
}

$("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem(KEY_STORE, $("key").value.trim());
  poll();
});
poll();
setInterval(poll, POLL_MS);
