// The specfleet dashboard: polls GET /v1/fleet at most 1 s apart and draws what it says.
// Plain DOM and canvas, no libraries. Text from the server goes in through textContent only.
"use strict";

const POLL_MS = 1000;
const HISTORY_S = 600;
const COLORS = ["#1570ef", "#dd2590", "#12b76a", "#f79009", "#7a5af8", "#0e9384", "#e04f16", "#667085"];
let history = [];
let lastT = null;

const $ = (id) => document.getElementById(id);
const fmt = (v, digits = 1, unit = "") => (v === null || v === undefined ? "–" : Number(v).toFixed(digits) + unit);
const ms = (s) => (s === null || s === undefined ? "–" : (1000 * s).toFixed(s < 0.1 ? 1 : 0) + " ms");
function bytes(b) {
  if (b === null || b === undefined) return "–";
  const [scale, unit] = b >= 2 ** 30 ? [2 ** 30, " GiB"] : b >= 2 ** 20 ? [2 ** 20, " MiB"] : [1024, " KiB"];
  return (b / scale).toFixed(b >= 10 * scale ? 0 : 1) + unit;
}

function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function fillTable(id, rows, empty, render) {
  const body = $(id).querySelector("tbody");
  const trs = rows.map((row) => {
    const tr = document.createElement("tr");
    render(row, tr);
    return tr;
  });
  if (!trs.length) {
    const tr = document.createElement("tr");
    const td = cell(empty, "empty");
    td.colSpan = $(id).querySelectorAll("thead th").length;
    tr.appendChild(td);
    trs.push(tr);
  }
  body.replaceChildren(...trs);
}

function showBanner(text, error) {
  const b = $("banner");
  b.hidden = !text;
  b.textContent = text || "";
  b.className = error ? "banner error" : "banner";
}

function renderVerifier(v, tr) {
  tr.dataset.url = v.url;
  tr.appendChild(cell(v.url));
  if (!v.up) {
    tr.appendChild(cell("unreachable", "down"));
    const td = cell(v.error, "empty");
    td.colSpan = 8;
    tr.appendChild(td);
    return;
  }
  const p = v.policies || {};
  const kv = v.kv;
  tr.append(cell(v.ready ? "up" : "starting"), cell(v.engine.backend), cell(v.engine.model), cell(v.engine.dtype),
    cell([p.allocation, p.batching, p.trim, p.fill].filter(Boolean).join(" · ") || "–"), cell(String(v.sessions)),
    cell(fmt(v.batch_sessions)), cell(v.step_ms === null ? "–" : fmt(v.step_ms, 1, " ms")),
    cell(kv ? bytes(kv.reserved_bytes) + " / " + bytes(kv.free_bytes) : "–"));
}

function renderDrafter(d, tr) {
  tr.dataset.node = d.node;
  const since = new Date(d.connected_since * 1000);
  tr.append(cell(d.node), cell(d.model), cell(String(d.sessions)),
    cell(d.acceptance === null ? "–" : fmt(100 * d.acceptance, 0, " %")), cell(fmt(d.drafted_tokens_s)),
    cell(d.rtt_ms === null ? "–" : fmt(d.rtt_ms, 1, " ms")), cell(d.budget === null ? "–" : fmt(d.budget)),
    cell(d.trusted ? "yes" : "no (ids only)"), cell(since.toLocaleTimeString()));
}

function render(view) {
  const status = $("status");
  status.textContent = view.status === "ready" ? "ready" : "not ready";
  status.className = "pill " + view.status;
  const noDrafter = view.drafters.length === 0 && view.verifiers.some((v) => v.up);
  showBanner(view.missing.length ? view.missing.join("; ") + (noDrafter ? " — requests run target-only." : "") : "",
    view.verifiers.every((v) => !v.up));
  const s = view.speed;
  $("tokens-s").textContent = fmt(s.tokens_s);
  $("ttft").textContent = ms(s.ttft_p50_s) + " / " + ms(s.ttft_p99_s);
  $("tpot").textContent = ms(s.tpot_p50_s) + " / " + ms(s.tpot_p99_s);
  $("per-forward").textContent = fmt(s.tokens_per_forward, 2);
  $("speedup").textContent = s.speedup_estimate === null ? "–" : fmt(s.speedup_estimate, 2, "×");
  $("speedup-method").textContent = "speedup: " + s.speedup_method;
  $("in-flight").textContent = String(view.requests.in_flight);
  $("queued").textContent = view.requests.queued === null ? "unknown" : String(view.requests.queued);
  $("rejected").textContent = String(view.requests.rejected_429);
  fillTable("verifiers", view.verifiers, "No verifier configured.", renderVerifier);
  fillTable("drafters", view.drafters, "No drafter connected: requests are served by the target alone.",
    renderDrafter);
  $("updated").textContent = "updated " + new Date(view.time * 1000).toLocaleTimeString();
}

function merge(points, now) {
  history = history.concat(points).filter((p) => p.t > now - HISTORY_S);
  if (history.length) lastT = history[history.length - 1].t;
}

function chart(id, series, opts) {
  const canvas = $(id);
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, left = 40, bottom = 18;
  ctx.clearRect(0, 0, w, h);
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = "#667085";
  const values = series.flatMap((s) => s.points.map((p) => p[1]));
  if (!values.length) {
    ctx.fillText("no data yet: the chart fills in as the fleet runs", left, h / 2);
    return;
  }
  const now = Date.now() / 1000;
  const first = Math.min(...series.flatMap((s) => s.points.map((p) => p[0])));
  const span = Math.min(HISTORY_S, Math.max(60, now - first));  // up to 10 minutes: what there is so far
  const top = Math.max(opts.max !== undefined ? opts.max : 0, ...values) || 1;
  const x = (t) => left + ((t - (now - span)) / span) * (w - left - 4);
  const y = (v) => h - bottom - (v / top) * (h - bottom - 8);
  ctx.strokeStyle = "#d0d5dd";
  ctx.beginPath();
  ctx.moveTo(left, y(0));
  ctx.lineTo(w, y(0));
  ctx.stroke();
  ctx.fillText(opts.label(top), 2, y(top) + 8);
  ctx.fillText(opts.label(0), 2, y(0));
  ctx.fillText(span >= HISTORY_S ? "−10 min" : "−" + Math.round(span) + " s", left, h - 4);
  ctx.fillText("now", w - 26, h - 4);
  for (const s of series) {
    ctx.strokeStyle = s.color;
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    s.points.forEach(([t, v], i) => (i ? ctx.lineTo(x(t), y(v)) : ctx.moveTo(x(t), y(v))));
    ctx.stroke();
  }
}

function drawCharts() {
  chart("chart-tokens", [{ color: COLORS[0], points: history.map((p) => [p.t, p.tokens_s]) }],
    { label: (v) => v.toFixed(0) });
  chart("chart-queue", [{ color: COLORS[3], points: history.filter((p) => p.queue !== null).map((p) => [p.t, p.queue]) }],
    { label: (v) => v.toFixed(0) });
  const nodes = [...new Set(history.flatMap((p) => Object.keys(p.acceptance)))].sort();
  const series = nodes.map((node, i) => ({
    node, color: COLORS[i % COLORS.length],
    points: history.filter((p) => node in p.acceptance).map((p) => [p.t, p.acceptance[node]]),
  }));
  chart("chart-acceptance", series, { max: 1, label: (v) => (100 * v).toFixed(0) + "%" });
  $("legend").replaceChildren(...series.map((s) => {
    const span = document.createElement("span");
    span.textContent = s.node;
    span.style.setProperty("--c", s.color);
    return span;
  }));
}

async function poll() {
  const started = Date.now();
  try {
    const url = "/v1/fleet" + (lastT === null ? "" : "?since=" + encodeURIComponent(lastT));
    const resp = await fetch(url, { cache: "no-store", credentials: "same-origin" });
    if (resp.status === 401) throw new Error("the API key was refused (401): reload the page to sign in again");
    if (!resp.ok) throw new Error("GET /v1/fleet answered " + resp.status);
    const view = await resp.json();
    render(view);
    merge(view.history, view.time);
  } catch (err) {
    const status = $("status");
    status.textContent = "no contact";
    status.className = "pill error";
    showBanner("The dashboard cannot reach the coordinator: " + err.message + ". Retrying every second.", true);
  }
  drawCharts();
  setTimeout(poll, Math.max(POLL_MS - (Date.now() - started), 0));  // starts at most POLL_MS apart
}

document.addEventListener("DOMContentLoaded", poll);
