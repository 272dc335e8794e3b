// The localserve dashboard: live scheduler view, models, chat playground, batches, hardware.
// Talks to the daemon's own API with fetch (EventSource cannot send the API key header); the key,
// when the server needs one, is asked once and kept in sessionStorage, never in a URL.
"use strict";
const LANES = ["interactive", "default", "batch"];
const HISTORY = 300; // chart points: five minutes at one snapshot a second
const KEY_ITEM = "localserve-api-key";
const $ = (sel) => document.querySelector(sel);
const app = { key: sessionStorage.getItem(KEY_ITEM), history: {}, chat: [], abort: null, pullSeen: [], batchSeen: {}, last: null, laneTokens: null, share: null };
window.__dashboard = app; // tests and curious users read the last snapshot and the pull and batch progress here
const keyRequired = $('meta[name="localserve-key-required"]').content === "1";

function authHeaders(extra) {
  const h = Object.assign({}, extra);
  if (app.key) h.Authorization = "Bearer " + app.key;
  return h;
}

async function api(path, options = {}) {
  const response = await fetch(path, Object.assign({}, options, { headers: authHeaders(options.headers) }));
  if (response.status === 401) { askKey("That key was not accepted."); throw new Error("unauthorized"); }
  return response;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return typeof body.error === "string" ? body.error : (body.error && body.error.message) || response.statusText;
  } catch (e) { return response.statusText; }
}

function bytes(n) {
  if (!n) return "0 B";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  const i = Math.min(units.length - 1, Math.floor(Math.log(n) / Math.log(1024)));
  return (n / 1024 ** i).toFixed(i ? 1 : 0) + " " + units[i];
}
const ms = (s) => (s == null ? "–" : (s * 1000).toFixed(s < 0.01 ? 1 : 0) + " ms");
const sleep = (t) => new Promise((r) => setTimeout(r, t));
function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) if (k.startsWith("on")) e.addEventListener(k.slice(2), v); else e.setAttribute(k, v);
  for (const c of children) e.append(c);
  return e;
}

// --- API key -----------------------------------------------------------------------------------
function askKey(message) {
  $("#key-form").hidden = false;
  $("#key-error").textContent = message || "";
  $("#key-input").focus();
}
$("#key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  app.key = $("#key-input").value.trim();
  sessionStorage.setItem(KEY_ITEM, app.key);
  $("#key-form").hidden = true;
  start();
});

// --- tabs --------------------------------------------------------------------------------------
function showTab() {
  const hash = location.hash.slice(1) || "scheduler";
  // The hash is the URL's, anyone's to write: escaped, `#x"]` is a tab that does not exist, not a
  // broken selector that throws before the page starts.
  const link = document.querySelector(`nav a[href="#${CSS.escape(hash)}"]`);
  const tab = link ? link.dataset.tab : "scheduler";
  for (const section of document.querySelectorAll("main > section")) section.hidden = section.id !== "tab-" + tab;
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a === link);
  if (tab === "models") refreshModels();
  if (tab === "chat") refreshModels();
  if (tab === "hardware") showHardware();
  if (tab === "batches") watchBatches();
  if (hash === "pull") $("#pull-name").focus();
}
window.addEventListener("hashchange", showTab);

// --- live scheduler view -----------------------------------------------------------------------
const LANE_COLORS = { interactive: "#1a7f37", default: "#1f6feb", batch: "#8250df" };
const FIGURE_NAMES = { ttft: "TTFT", itl: "ITL", queue: "queue wait", step: "step time" };
const WINDOWS = ["1m", "15m"];
const QS = ["p50", "p95", "p99"];

function card(name) {
  let c = document.querySelector(`.card[data-model="${CSS.escape(name)}"]`);
  if (c) return c;
  const fig = (field, label) => el("div", { class: "figure" }, el("b", { "data-field": field }, "–"), label);
  const chart = (field, label) => el("div", { class: "chart" }, el("canvas", { "data-chart": field }), el("span", {}, label));
  const head = (...names) => el("thead", {}, el("tr", {}, ...names.map((n) => el("th", {}, n))));
  c = el("div", { class: "card", "data-model": name }, el("h3", {}, name),
    el("div", { class: "figures" },
      fig("tps", "tok/s (decode)"), fig("prompt_tps", "tok/s (prompt)"), fig("running", "running"), fig("kv", "KV cells used"),
      ...LANES.map((lane) => fig("lane-" + lane, "queued: " + lane)),
      fig("hit", "prefix-cache hits"), fig("ttft", "TTFT p50 / p95 (1 min)"), fig("itl", "ITL p50 / p95 (1 min)"), fig("steps", "steps"),
      fig("spec", "drafts accepted · tokens per verification")),
    el("div", { class: "kvbar", title: "KV cells: running sequences, parked prefix cache, free" },
      el("span", { class: "kv-running" }), el("span", { class: "kv-parked" }), el("span", { class: "kv-free" })),
    el("div", { class: "muted kvtext", "data-field": "kvsplit" }, ""),
    el("div", { class: "muted spectext", "data-field": "specsplit" }, ""),
    el("div", { class: "charts" },
      chart("tokens", "tok/s: decode (blue), prompt (orange)"), chart("queue", "running (blue), queued (red)"),
      chart("mix", "step rows/s: decode (blue), prompt (orange); interrupted steps (red)"), chart("hit", "prefix-cache hit rate")),
    el("h4", {}, "Latency, exact over the last minute and 15 minutes"),
    el("table", { class: "latency" }, head("", "lane", ...WINDOWS.flatMap((w) => [...QS.map((q) => `${w} ${q}`), `${w} n`])), el("tbody")),
    el("h4", {}, "Requests in the batch"),
    el("table", { class: "seqs" }, head("lane", "client", "prompt", "generated", "cached", "age", "state", ""), el("tbody")),
    el("p", { class: "muted no-seqs" }, "Nothing running."));
  $("#model-cards").append(c);
  return c;
}

function push(list, value) { list.push(value); if (list.length > HISTORY) list.shift(); }

function latencyRows(latency) {
  const rows = [];
  for (const figure of Object.keys(FIGURE_NAMES)) {
    const windows = latency[figure];
    // A lane's row once it has samples; "all" always (step time has no lane: a step serves every lane).
    const lanes = ["all", ...LANES.filter((lane) => windows["15m"][lane].n > 0 || windows["1m"][lane].n > 0)];
    for (const lane of lanes) {
      const cells = WINDOWS.flatMap((w) => [...QS.map((q) => el("td", { "data-lat": `${figure}.${w}.${lane}.${q}` }, ms(windows[w][lane][q]))),
        el("td", { "data-lat": `${figure}.${w}.${lane}.n` }, String(windows[w][lane].n))]);
      rows.push(el("tr", {}, el("th", {}, lane === "all" ? FIGURE_NAMES[figure] : ""), el("td", {}, laneTag(lane)), ...cells));
    }
  }
  return rows;
}

function laneTag(lane) {
  return el("span", { class: "lane" }, el("i", { "data-lane": lane }), lane);
}

function sequenceRow(m, r) {
  const prompt = el("td", {}, el("progress", { max: String(r.prompt_tokens || 1), value: String(r.prompt_done) }),
    ` ${r.prompt_done} / ${r.prompt_tokens}`);
  return el("tr", { "data-request": r.id, "data-state": r.state, "data-generated": String(r.generated) },
    el("td", {}, laneTag(r.lane)), el("td", {}, `${r.dialect} ${r.route}`), prompt,
    el("td", { class: "num" }, String(r.generated)), el("td", { class: "num" }, String(r.cached)),
    el("td", { class: "num" }, r.age_s.toFixed(1) + " s"), el("td", { class: "state" }, stateText(r)),
    el("td", {}, el("button", { class: "cancel", onclick: () => cancelRequest(r.id) }, "Cancel")));
}

// A waiting request's lane without progress for a while: the queue timeout counts this, not its age.
function stateText(r) {
  return r.state === "waiting" && r.stalled_s >= 1 ? `waiting, lane idle ${r.stalled_s.toFixed(0)} s` : r.state;
}

async function cancelRequest(id) {
  const response = await api(`/api/dashboard/requests/${encodeURIComponent(id)}/cancel`, { method: "POST" });
  // 404: it finished meanwhile; the next snapshot drops its row.
  if (!response.ok && response.status !== 404) alert(await errorText(response));
}

function onSnapshot(snap) {
  app.last = snap;
  $("#summary").textContent = snap.summary;
  const names = new Set(snap.models.filter((m) => m.state === "loaded").map((m) => m.name));
  for (const c of document.querySelectorAll(".card")) if (!names.has(c.dataset.model)) c.remove();
  $("#no-models").hidden = names.size > 0;
  for (const m of snap.models) {
    if (m.state !== "loaded") continue;
    const h = app.history[m.name] || (app.history[m.name] = { tps: [], ptps: [], running: [], queued: [], hit: [], decode: [], prompt: [], interrupted: [] });
    const queued = LANES.reduce((sum, lane) => sum + (m.waiting[lane] || 0), 0);
    push(h.tps, m.tokens_per_s); push(h.ptps, m.prompt_tokens_per_s); push(h.running, m.running);
    push(h.queued, queued); push(h.hit, m.prefix_cache_hit_rate);
    const mix = m.step_mix || { seconds: 0 };
    if (mix.seconds > 0) {
      push(h.decode, mix.decode_rows / mix.seconds); push(h.prompt, mix.prompt_rows / mix.seconds);
      push(h.interrupted, mix.interrupted / mix.seconds);
    }
    const c = card(m.name);
    const set = (field, text) => { c.querySelector(`[data-field="${field}"]`).textContent = text; };
    set("tps", m.tokens_per_s.toFixed(1)); set("prompt_tps", m.prompt_tokens_per_s.toFixed(1));
    set("running", `${m.running} / ${m.max_sequences}`); set("kv", `${m.kv_used} / ${m.kv_total}`);
    for (const lane of LANES) set("lane-" + lane, String(m.waiting[lane] || 0));
    set("hit", (100 * m.prefix_cache_hit_rate).toFixed(0) + " %"); set("steps", String(m.steps));
    const now = m.latency.ttft["1m"].all, itl = m.latency.itl["1m"].all;
    const pair = (f) => (f.n ? `${ms(f.p50).replace(" ms", "")} / ${ms(f.p95)}` : "– / –");
    set("ttft", pair(now)); set("itl", pair(itl));
    const spec = m.speculation || { mode: "off", lanes: {} };
    const drafting = LANES.filter((lane) => (spec.lanes[lane] || {}).drafted > 0);
    set("spec", spec.tokens_per_verification ? `${(100 * spec.acceptance).toFixed(0)} % · ${spec.tokens_per_verification.toFixed(1)}` : "–");
    set("specsplit", `Speculative decoding: ${spec.mode}` + (drafting.length ? "; drafted / accepted: " +
      drafting.map((lane) => `${lane} ${spec.lanes[lane].drafted} / ${spec.lanes[lane].accepted}`).join(", ") : ""));
    if (m.kv) {
      const part = (n) => (m.kv.total ? (100 * n) / m.kv.total : 0) + "%";
      c.querySelector(".kv-running").style.width = part(m.kv.running);
      c.querySelector(".kv-parked").style.width = part(m.kv.parked);
      c.querySelector(".kv-free").style.width = part(m.kv.free);
      set("kvsplit", `KV cells: ${m.kv.running} running, ${m.kv.parked} parked prefix cache, ${m.kv.free} free of ${m.kv.total}`);
    }
    c.querySelector(".latency tbody").replaceChildren(...latencyRows(m.latency));
    const seqs = m.sequences || [];
    c.querySelector(".seqs tbody").replaceChildren(...seqs.map((r) => sequenceRow(m, r)));
    c.querySelector(".no-seqs").hidden = seqs.length > 0;
    const draw = (name, series) => Charts.draw(c.querySelector(`[data-chart="${name}"]`), series);
    draw("tokens", [{ values: h.tps, color: "#1f6feb" }, { values: h.ptps, color: "#e16f24" }]);
    draw("queue", [{ values: h.running, color: "#1f6feb" }, { values: h.queued, color: "#cf222e" }]);
    Charts.stacked(c.querySelector('[data-chart="mix"]'), [{ values: h.decode, color: "#1f6feb" }, { values: h.prompt, color: "#e16f24" }],
      { values: h.interrupted, color: "#cf222e" });
    draw("hit", [{ values: h.hit, color: "#1a7f37" }]);
  }
  renderTraffic(snap);
  renderLoaded(snap.models);
}

// Where traffic comes from: requests per dialect and route, and each lane's share of the tokens
// processed in each second.
function renderTraffic(snap) {
  $("#traffic tbody").replaceChildren(...snap.traffic.map((t) => el("tr", { "data-route": t.route, "data-dialect": t.dialect },
    el("td", {}, t.dialect), el("td", {}, el("code", {}, t.route)), el("td", { class: "num" }, String(t.requests)))));
  $("#no-traffic").hidden = snap.traffic.length > 0;
  const previous = app.laneTokens;
  app.laneTokens = snap.lane_tokens;
  if (!previous) return;
  const share = app.share || (app.share = Object.fromEntries(LANES.map((lane) => [lane, []])));
  const deltas = LANES.map((lane) => Math.max(0, snap.lane_tokens[lane] - previous[lane]));
  const total = deltas.reduce((a, b) => a + b, 0);
  LANES.forEach((lane, i) => push(share[lane], total ? deltas[i] / total : 0));
  Charts.stacked($('#lane-share'), LANES.map((lane) => ({ values: share[lane], color: LANE_COLORS[lane] })));
}

async function streamStats() {
  for (;;) {
    try {
      const response = await api("/api/dashboard/stats");
      if (!response.ok) throw new Error(await errorText(response));
      $("#conn").textContent = "live";
      for await (const event of pieces(response, "\n\n", false)) {
        for (const line of event.split("\n")) if (line.startsWith("data:")) onSnapshot(JSON.parse(line.slice(5)));
      }
    } catch (e) {
      if (e.message === "unauthorized") return;
    }
    $("#conn").textContent = "reconnecting…";
    await sleep(2000);
  }
}

// --- models ------------------------------------------------------------------------------------
function renderLoaded(models) {
  const body = $("#loaded tbody");
  body.replaceChildren(...models.map((m) => el("tr", { "data-model": m.name },
    el("td", {}, m.name), el("td", { class: "memory" }, memoryText(m)), el("td", {}, m.device || "–"),
    // A request waiting for a load says which model must drain first (runtime/swaps.py).
    el("td", {}, m.state === "failed" ? `failed: ${m.reason}` : m.reason ? `${m.state}: ${m.waiting_for_load} waiting, ${m.reason}`
      : m.pinned ? "in use" : m.expires_in == null ? "forever" : `${Math.round(m.expires_in)} s`),
    el("td", { class: "worker" }, workerText(m)),
    el("td", {}, m.state === "waiting" ? ""
      // A model marked failed after its engine kept crashing loads again only when asked (runtime/crashes.py).
      : m.state === "failed" ? el("button", { class: "load", onclick: () => loadModel(m.name) }, "Load again")
      : el("button", { class: "unload", onclick: () => unload(m.name) }, "Unload")))));
}

// Held now and the most it may grow to: KV memory is committed as requests use it, so an idle
// model holds far less than its plan (runtime/status_rows.py).
function memoryText(m) {
  const held = m.memory_held_bytes == null ? "–" : bytes(m.memory_held_bytes);
  return `${held} (at most ${bytes(m.memory_max_bytes ?? m.memory_bytes)})`;
}

function workerText(m) {
  const parts = m.worker ? [`pid ${m.worker.pid}, up ${duration(m.worker.uptime_s)}`] : [];
  if (m.restarts) parts.push(`${m.restarts} restart${m.restarts === 1 ? "" : "s"}`);
  return parts.join(", ") || "–";
}

function duration(s) {
  return s < 90 ? `${Math.round(s)} s` : s < 5400 ? `${Math.round(s / 60)} min` : `${(s / 3600).toFixed(1)} h`;
}

async function loadModel(name) {
  // Ollama's way: an empty request loads the model.
  const response = await api("/api/generate", { method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ model: name }) });
  if (!response.ok) alert(await errorText(response));
}

async function unload(name) {
  // Ollama's way: an empty request with keep_alive 0 unloads the model.
  const response = await api("/api/generate", { method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ model: name, keep_alive: 0 }) });
  if (!response.ok) alert(await errorText(response));
}

async function refreshModels() {
  const response = await api("/api/tags");
  if (!response.ok) return;
  const models = (await response.json()).models;
  $("#installed tbody").replaceChildren(...models.map((m) => el("tr", { "data-model": m.name },
    el("td", {}, m.name), el("td", {}, bytes(m.size)), el("td", {}, (m.details || {}).quantization_level || "–"),
    el("td", {}, el("button", { class: "delete", onclick: () => removeModel(m.name) }, "Delete")))));
  const select = $("#chat-model");
  const current = select.value;
  select.replaceChildren(...models.map((m) => el("option", {}, m.name)));
  if (current) select.value = current;
}

async function removeModel(name) {
  if (!confirm(`Delete ${name} from this machine?`)) return;
  const response = await api("/api/delete", { method: "DELETE", headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ model: name }) });
  if (!response.ok) alert(await errorText(response));
  refreshModels();
}

// The response body cut at `separator` (SSE events at "\n\n", NDJSON lines at "\n"); with
// `keepTail`, an unterminated last piece is yielded too.
async function* pieces(response, separator, keepTail) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf(separator)) >= 0) {
      yield buffer.slice(0, end);
      buffer = buffer.slice(end + separator.length);
    }
  }
  if (keepTail && buffer.trim()) yield buffer;
}

function lines(response) {
  return pieces(response, "\n", true);
}

$("#pull-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const name = $("#pull-name").value.trim();
  if (!name) return;
  const bar = $("#pull-progress"), status = $("#pull-status");
  bar.hidden = false; bar.value = 0; app.pullSeen = []; status.textContent = "starting…";
  try {
    const response = await api("/api/pull", { method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ model: name, stream: true }) });
    if (!response.ok) { status.textContent = await errorText(response); return; }
    for await (const line of lines(response)) {
      if (!line.trim()) continue;
      const event = JSON.parse(line);
      if (event.error) { status.textContent = "failed: " + event.error; return; }
      if (event.total) { bar.value = (100 * (event.completed || 0)) / event.total; app.pullSeen.push(bar.value); }
      status.textContent = event.status;
    }
    refreshModels();
  } catch (e) {
    if (e.message !== "unauthorized") status.textContent = "failed: " + e.message;
  }
});

// --- chat playground ---------------------------------------------------------------------------
$("#chat-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const text = $("#chat-input").value.trim();
  if (!text || app.abort) return;
  $("#chat-input").value = "";
  app.chat.push({ role: "user", content: text });
  const log = $("#chat-log");
  log.append(el("div", { class: "user" }, text));
  const answer = el("div", { class: "assistant" });
  log.append(answer);
  const system = $("#chat-system").value.trim();
  const messages = (system ? [{ role: "system", content: system }] : []).concat(app.chat);
  app.abort = new AbortController();
  $("#chat-stop").disabled = false; $("#chat-send").disabled = true;
  let reply = "";
  try {
    const response = await api("/v1/chat/completions", { method: "POST", signal: app.abort.signal,
      headers: { "Content-Type": "application/json", "X-Priority": $("#chat-lane").value },
      body: JSON.stringify({ model: $("#chat-model").value, messages, stream: true,
        temperature: Number($("#chat-temp").value) }) });
    if (!response.ok) { answer.textContent = await errorText(response); answer.className = "error"; return; }
    for await (const line of lines(response)) {
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data === "[DONE]") break;
      const event = JSON.parse(data);
      if (event.error) { answer.className = "error"; answer.textContent = event.error.message; break; }
      for (const choice of event.choices || []) reply += (choice.delta && choice.delta.content) || "";
      answer.textContent = reply;
    }
  } catch (e) {
    if (e.name !== "AbortError" && e.message !== "unauthorized") { answer.className = "error"; answer.textContent = e.message; }
  } finally {
    if (reply) app.chat.push({ role: "assistant", content: reply });
    answer.dataset.done = "1";
    app.abort = null;
    $("#chat-stop").disabled = true; $("#chat-send").disabled = false;
  }
});
$("#chat-stop").addEventListener("click", () => app.abort && app.abort.abort());

// --- batches -----------------------------------------------------------------------------------
// The Batch API's own list (GET /v1/batches), polled while the tab is open: batches change over
// minutes, and a poll costs the daemon one SQLite read.
const BATCH_POLL_MS = 1000;
const BATCH_FINAL = new Set(["completed", "failed", "expired", "cancelled", "cancelling"]);
let watchingBatches = false;

async function watchBatches() {
  if (watchingBatches) return;
  watchingBatches = true;
  try {
    while (!$("#tab-batches").hidden) {
      await refreshBatches();
      await sleep(BATCH_POLL_MS);
    }
  } catch (e) {
    if (e.message !== "unauthorized") $("#batches-error").textContent = e.message;
  } finally {
    watchingBatches = false;
  }
}

async function refreshBatches() {
  const response = await api("/v1/batches?limit=100");
  if (!response.ok) { $("#batches-error").textContent = await errorText(response); return; }
  $("#batches-error").textContent = "";
  const batches = (await response.json()).data;
  $("#no-batches").hidden = batches.length > 0;
  $("#batches tbody").replaceChildren(...batches.map(batchRow));
}

function batchRow(b) {
  const counts = b.request_counts || { total: 0, completed: 0, failed: 0 };
  const done = counts.completed + counts.failed;
  const seen = app.batchSeen[b.id] || (app.batchSeen[b.id] = []);
  if (seen[seen.length - 1] !== done) seen.push(done);
  const progress = el("td", {}, el("progress", { max: String(counts.total || 1), value: String(done) }),
    ` ${done} / ${counts.total}` + (counts.failed ? ` (${counts.failed} failed)` : ""));
  const action = BATCH_FINAL.has(b.status) ? "" : el("button", { class: "cancel", onclick: () => cancelBatch(b.id) }, "Cancel");
  return el("tr", { "data-batch": b.id, "data-status": b.status },
    el("td", {}, b.id), el("td", {}, b.endpoint), el("td", { class: "status" }, b.status), progress,
    el("td", {}, new Date(b.created_at * 1000).toLocaleString()), el("td", {}, action));
}

async function cancelBatch(id) {
  if (!confirm(`Cancel batch ${id}? Lines already answered stay in its output file.`)) return;
  const response = await api(`/v1/batches/${encodeURIComponent(id)}/cancel`, { method: "POST" });
  if (!response.ok) alert(await errorText(response));
  refreshBatches();
}

// --- hardware ----------------------------------------------------------------------------------
function table(rows) {
  return el("table", {}, el("tbody", {}, ...rows.map(([k, v]) => el("tr", {}, el("th", {}, k),
    el("td", {}, typeof v === "object" && v !== null ? JSON.stringify(v) : String(v))))));
}

async function showHardware() {
  const response = await api("/api/dashboard/hardware");
  if (!response.ok) { $("#hw").textContent = await errorText(response); return; }
  const data = await response.json();
  $("#hw").replaceChildren(el("h2", {}, "This machine"), table(Object.entries(data.hardware)),
    el("h2", {}, "Where each model runs"),
    table(data.placements.map((p) => [p.name, `${p.device || "–"}: ${p.reason || ""}`])));
}

// --- start -------------------------------------------------------------------------------------
let started = false;
function start() {
  if (started) return;
  started = true;
  showTab();
  streamStats();
}
if (keyRequired && !app.key) askKey(); else start();
