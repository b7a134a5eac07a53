// afmd's dashboard: polls /ui/api/ and talks to the API itself, on this origin only.
// The API key (when the server has one) lives in sessionStorage for this tab, nowhere else.
"use strict";

const KEY_STORAGE = "afmd.apiKey";
const POLL_MS = 1000;
const SLOW_MS = 2500; // a poll unanswered this long: the page says it is waiting
const POLL_TIMEOUT_MS = 15000; // a poll unanswered this long is dropped, and sent again
const STATUS_EVERY = 10; // polls between two status reads
const REQUESTS_SHOWN = 50;
const CHART_SECONDS = 300;

const $ = (id) => document.getElementById(id);
const el = (tag, attrs = {}, ...children) => {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else if (name === "testid") node.dataset.testid = value;
    else node.setAttribute(name, value);
  }
  for (const child of children) node.append(child);
  return node;
};

// What a poll writes, it writes only where it changed: rewriting a node, even with the same
// text, drops the user's selection in it, so nothing could be selected to copy for longer
// than a second (a model id, the config file, a request).
function setText(node, text) {
  if (node.textContent !== text) node.textContent = text;
}

// A focused button that is disabled or removed drops the focus to the top of the page: a
// keyboard or screen reader user loses their place. A button busy with its action is
// marked aria-disabled instead (it keeps the focus and ignores clicks), and one replaced
// passes the focus on.
function busy(button, on) {
  if (on) button.setAttribute("aria-disabled", "true");
  else button.removeAttribute("aria-disabled");
}

const isBusy = (button) => button.getAttribute("aria-disabled") === "true";

function replaceIfChanged(node, key, build) {
  if (node.dataset.key === key) return;
  node.dataset.key = key;
  node.replaceChildren(...build());
}

// ------------------------------------------------------------------ formatting

function bytes(n) {
  if (n === null || n === undefined) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(i === 0 ? 0 : 1)} ${units[i]}`;
}

function seconds(s) {
  if (s === null || s === undefined) return "—";
  s = Math.max(0, Math.round(s));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  const h = Math.floor(s / 3600);
  if (h < 48) return `${h}h ${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(h / 24)}d ${h % 24}h`;
}

const ms = (v) => (v === null || v === undefined ? "—" : `${Math.round(v)} ms`);
const clock = (t) => new Date(t * 1000).toLocaleTimeString([], { hour12: false });

// ------------------------------------------------------------------ the key and the API

class Unauthorized extends Error {
  constructor(message, key) { super(message); this.key = key; } // the key it refused
}

class APIError extends Error {
  constructor(status, message, code) { super(message); this.status = status; this.code = code; }
}

function apiKey() { return sessionStorage.getItem(KEY_STORAGE) || ""; }

function unsendable(key) {
  // A header carries ISO-8859-1 and no control characters: fetch refuses anything else
  // before it sends, so such a key (pasted with a zero-width space, say) could never be
  // tried, only fail every read as if the server were gone.
  let i = 0;
  for (const ch of key) {
    i += 1;
    const code = ch.codePointAt(0);
    if (code > 0xff || code < 0x20 || code === 0x7f) {
      const name = `U+${code.toString(16).toUpperCase().padStart(4, "0")}`;
      return `The key cannot be sent: its character ${i} (${name}) is not allowed in an `
        + "HTTP header; it may have been pasted with the key. Type or paste it again without it.";
    }
  }
  return null;
}

function headers(extra = {}) {
  const h = { ...extra };
  const key = apiKey();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function errorOf(response) {
  let message = `HTTP ${response.status}`;
  let code = null;
  try {
    const body = await response.json();
    const err = body.error || body;
    if (err && err.message) message = err.message;
    if (err && err.code) code = err.code;
  } catch (_) { /* not JSON */ }
  return new APIError(response.status, message, code);
}

async function api(path, options = {}) {
  const init = { ...options, headers: headers(options.headers || {}), cache: "no-store" };
  if (options.json !== undefined) {
    init.method = init.method || "POST";
    init.body = JSON.stringify(options.json);
    init.headers["Content-Type"] = "application/json";
    delete init.json;
  }
  const key = apiKey();
  const response = await fetch(path, init);
  if (response.status === 401) throw new Unauthorized((await errorOf(response)).message, key);
  if (!response.ok) throw await errorOf(response);
  return response.json();
}

// ------------------------------------------------------------------ state

const view = {
  status: null,
  statusAt: 0, // performance.now() when status was read
  models: [],
  seq: 0, // last request seen
  after: 0, // last series second seen
  requests: [],
  series: [],
  polls: 0,
  instance: null, // the server answering (another one on the same address counts anew)
  inFlight: null, // performance.now() when the poll under way started
  again: false, // poll again as soon as the one under way ends
  timer: null,
  lost: false, // the server does not answer: the uptime stops where it was last told
  busy: new Set(), // model ids with an action under way
};

function showKeyPanel(message) {
  stopPolling();
  $("main").hidden = true;
  $("key-panel").hidden = false;
  $("key-error").textContent = message || "";
  $("api-key").focus();
}

function keyRefused(message, refused) {
  // An answer to a key replaced since (typed again while the first was being checked) says
  // nothing of the one kept now.
  if (refused !== apiKey()) return false;
  // However it was met (a poll, an action, a send), a refused key is forgotten, so a reload
  // does not try it again, and the panel says it was refused.
  sessionStorage.removeItem(KEY_STORAGE);
  showKeyPanel(refused ? `The server refused this key: ${message}` : "");
  return true;
}

function showMain() {
  // The key taken, its panel goes: the focus (in its field) would fall to the top of the
  // page, so it moves to the first panel.
  const asked = $("key-panel").contains(document.activeElement);
  $("key-panel").hidden = true;
  $("main").hidden = false;
  if (asked) $("models-title").focus();
}

function connection(ok, text) {
  const node = $("connection");
  setText(node, text);
  node.classList.toggle("lost", !ok);
  // A screen reader hears the change only: "updated 12:00:01" each second, or "has not
  // answered for 5s" counting, in a live region would be read out every second.
  if (ok === view.lost) $("connection-news").textContent = ok ? "The server answers again." : text;
  view.lost = !ok;
  // What the panels show is the last the server said, not what it holds now.
  $("main").classList.toggle("stale", !ok);
}

// ------------------------------------------------------------------ status

function renderStatus() {
  const s = view.status;
  if (!s) return;
  setText($("version"), s.version);
  const elapsed = (performance.now() - view.statusAt) / 1000;
  setText($("uptime"), seconds(s.now - s.started_at + elapsed));
  replaceIfChanged($("listeners"), JSON.stringify(s.listeners), () => s.listeners.map((l) => el("li", {
    "class": l.up ? "up" : "down", testid: "listener", text: l.address,
    title: l.up ? "accepting connections" : "down",
  })));
  setText($("config-file"), s.config_file || "none (built-in defaults)");
}

// ------------------------------------------------------------------ models

function keepAliveText(m, now) {
  if (m.state !== "loaded") return "—";
  if (m.active || m.queued) return "in use";
  if (m.expires_at !== null) return seconds(m.expires_at - now);
  if (m.keep_alive_s !== null && m.keep_alive_s < 0) return "forever";
  return "—";
}

function modelRow(m) {
  const row = el("tr", { testid: "model-row" });
  row.dataset.modelId = m.id;
  row.append(
    el("td", {}, el("span", { "class": "model-id", text: m.id })),
    el("td", { "class": "kind" }),
    el("td", {}, el("span", { "class": "state" }), el("span", { "class": "reason" })),
    el("td", { "class": "num memory-cell" }),
    el("td", { "class": "num active-cell" }),
    el("td", { "class": "num queued-cell" }),
    el("td", { "class": "num keep-cell" }),
    el("td", { "class": "actions" }),
  );
  return row;
}

// Why Apple's model cannot answer, which no load changes (this Mac, its settings, the OS
// still downloading the model): a Load button there could only fail. A model whose last
// load failed keeps its button, to try again.
const LASTING_REASONS = new Set(["device_not_eligible", "apple_intelligence_not_enabled",
  "model_not_ready"]);

function actionButton(id, action, label) {
  // Named with the model: a column of identical "Load"s says nothing to a screen reader.
  const button = el("button", { type: "button", testid: action, text: label,
    "aria-label": `${label} ${id}` });
  button.addEventListener("click", () => { if (!isBusy(button)) modelAction(id, action); });
  return button;
}

function updateModelRow(row, m, now) {
  row.dataset.state = m.state;
  row.dataset.source = m.source;
  const cells = row.children;
  const badges = [];
  if (m.default) badges.push("default");
  if (m.source !== "configured") badges.push(m.source);
  for (const alias of m.aliases) badges.push(`alias ${alias}`);
  replaceIfChanged(cells[0], JSON.stringify([m.id, badges]), () => [
    el("span", { "class": "model-id", text: m.id }),
    ...badges.map((text) => el("span", { "class": "badge", text }))]);
  setText(cells[1], m.kind || "—");
  const state = cells[2].children[0];
  setText(state, m.state);
  if (state.className !== `state ${m.state}`) state.className = `state ${m.state}`;
  setText(cells[2].children[1], m.reason ? ` ${m.reason}` : "");
  setText(cells[3], m.memory_bytes === null ? (m.size_bytes ? `${bytes(m.size_bytes)} on disk` : "—") : bytes(m.memory_bytes));
  setText(cells[4], String(m.active));
  setText(cells[5], String(m.queued));
  setText(cells[6], keepAliveText(m, now));
  // The actions a model's state allows, and only those (a row that is not loaded has no
  // unload button at all).
  const wanted = [];
  if (m.source !== "downloaded") {
    if (m.state === "loaded") wanted.push(["unload", "Unload"]);
    else if (m.state === "available"
      || (m.state === "unavailable" && !LASTING_REASONS.has(m.reason))) wanted.push(["load", "Load"]);
  }
  const actions = cells[7];
  const have = [...actions.children].map((b) => b.dataset.testid).join(",");
  if (have !== wanted.map((w) => w[0]).join(",")) {
    const focused = actions.contains(document.activeElement);
    actions.replaceChildren(...wanted.map(([action, label]) => actionButton(m.id, action, label)));
    // Unload pressed becomes Load; while the model loads there is no button: the cell holds
    // the focus until there is one.
    if (focused) {
      if (actions.firstElementChild) actions.firstElementChild.focus();
      else { actions.tabIndex = -1; actions.focus(); }
    }
  }
  for (const button of actions.children) busy(button, view.busy.has(m.id));
}

function renderModels(payload) {
  view.models = payload.models;
  const body = $("model-rows");
  const rows = new Map([...body.children].map((r) => [r.dataset.modelId, r]));
  const order = [];
  for (const m of payload.models) {
    let row = rows.get(m.id);
    if (!row) row = modelRow(m);
    rows.delete(m.id);
    updateModelRow(row, m, payload.now);
    order.push(row);
  }
  for (const gone of rows.values()) gone.remove();
  order.forEach((row, i) => { if (body.children[i] !== row) body.insertBefore(row, body.children[i] || null); });

  const mem = payload.memory;
  $("memory-bar").max = Math.max(1, mem.budget_bytes);
  $("memory-bar").value = mem.used_bytes;
  setText($("memory-text"),
    `${bytes(mem.used_bytes)} of ${bytes(mem.budget_bytes)} budget · ${mem.loaded} of ${mem.max_loaded} models loaded`);
  renderPulls(payload.pulls);
  renderModelChoices(payload.models);
}

// Rows are kept and changed in place, as the model rows are: rebuilt at every poll while a
// pull progresses, the list dropped whatever text the user had selected in it (a failed
// pull's message, to copy).
function renderPulls(pulls) {
  const list = $("pulls");
  const rows = new Map([...list.children].map((r) => [r.dataset.repo, r]));
  pulls.forEach((p, i) => {
    let item = rows.get(p.repo);
    if (!item) {
      const bar = el("progress", { testid: "pull-progress", max: "1", "aria-label": `pull ${p.repo}` });
      item = el("li", { testid: "pull-row" }, bar, el("span"));
      item.dataset.repo = p.repo;
    }
    rows.delete(p.repo);
    const done = p.total_bytes ? p.completed_bytes / p.total_bytes : 0;
    const bar = item.firstElementChild;
    const value = p.state === "done" ? 1 : done;
    if (bar.value !== value) bar.value = value;
    let text = `${p.repo}@${p.revision}: `;
    if (p.state === "pulling") text += p.total_bytes ? `${bytes(p.completed_bytes)} of ${bytes(p.total_bytes)} (${p.files_done}/${p.files} files)` : "listing files…";
    else if (p.state === "done") text += `done, ${p.files} files, ${bytes(p.total_bytes)} verified`;
    else text += `failed: ${p.error}`;
    setText(item.lastElementChild, text);
    if (item.className !== p.state) item.className = p.state;
    if (item.dataset.state !== p.state) item.dataset.state = p.state;
    if (list.children[i] !== item) list.insertBefore(item, list.children[i] || null);
  });
  for (const gone of rows.values()) gone.remove();
}

function failure(err) {
  // The server's own message; where there is none, the browser's ("Failed to fetch") says
  // little: the request never reached the server, or its answer never came back.
  if (err instanceof APIError || err instanceof Unauthorized) return err.message;
  return `the page cannot reach the server (${err.message}); it may not have been done`;
}

async function modelAction(id, action) {
  if (view.busy.has(id)) return;
  view.busy.add(id);
  $("model-error").textContent = "";
  for (const row of $("model-rows").children) {
    if (row.dataset.modelId === id) for (const b of row.querySelectorAll("button")) busy(b, true);
  }
  try {
    // Loading is answered once the model is in memory: poll meanwhile so the row says so.
    const pending = api(`/ui/api/${action}`, { json: { model: id } });
    setTimeout(refresh, 100);
    await pending;
  } catch (err) {
    if (err instanceof Unauthorized && keyRefused(err.message, err.key)) return;
    $("model-error").textContent = `${action} ${id}: ${failure(err)}`;
  } finally {
    view.busy.delete(id);
  }
  refresh();
}

async function startPull(event) {
  event.preventDefault();
  const repo = $("pull-repo").value.trim();
  if (!repo) return;
  $("model-error").textContent = "";
  try {
    await api("/ui/api/pull", { json: { model: repo } });
    // Another repo typed while this one was being started is the user's next pull.
    if ($("pull-repo").value.trim() === repo) $("pull-repo").value = "";
  } catch (err) {
    if (err instanceof Unauthorized && keyRefused(err.message, err.key)) return;
    $("model-error").textContent = `pull ${repo}: ${failure(err)}`;
  }
  refresh();
}

// ------------------------------------------------------------------ live

function renderActivity(payload) {
  setText($("active-requests"), `${payload.active} running · ${payload.queued} queued`);
  const shown = Object.entries(payload.models)
    .filter(([id, c]) => c.active || c.queued || view.models.some((m) => m.id === id && m.state === "loaded"));
  replaceIfChanged($("per-model"), JSON.stringify(shown), () => shown.map(([id, c]) => {
    const li = el("li", { testid: "model-activity" },
      el("span", { "class": "model-id", text: id }),
      el("span", { "class": "counts", text: `${c.active} running · ${c.queued} queued` }));
    li.dataset.modelId = id;
    return li;
  }));

  // Two polls may overlap (an action polls at once): keep only what is new.
  const requests = payload.requests.filter((r) => r.seq > view.seq);
  if (requests.length) {
    view.requests = view.requests.concat(requests).slice(-REQUESTS_SHOWN);
    // The new rows go on top; the rows already shown stay as they are.
    const body = $("request-rows");
    body.prepend(...requests.slice(-REQUESTS_SHOWN).reverse().map(requestRow));
    while (body.children.length > REQUESTS_SHOWN) body.lastElementChild.remove();
  }
  view.seq = Math.max(view.seq, payload.seq);
  const points = payload.series.filter((p) => p.t > view.after);
  if (points.length) {
    view.series = view.series.concat(points).slice(-CHART_SECONDS);
    view.after = points[points.length - 1].t;
    renderCharts();
  }
}

function requestRow(r) {
  const tokens = r.prompt_tokens === null ? "—" : `${r.prompt_tokens} → ${r.completion_tokens}`;
  const row = el("tr", { testid: "request-row" },
    el("td", { text: clock(r.time) }),
    el("td", { "class": "path", text: `${r.method} ${r.path}` }),
    el("td", { text: r.model || "—" }),
    el("td", { "class": r.status < 400 ? "status-ok" : "status-err",
      text: r.error_code ? `${r.status} ${r.error_code}` : String(r.status) }),
    el("td", { "class": "num", text: tokens }),
    el("td", { "class": "num", text: ms(r.ttft_ms) }),
    el("td", { "class": "num", text: ms(r.duration_ms) }),
    el("td", { text: r.finish_reason || "" }));
  row.dataset.requestId = r.request_id || "";
  row.title = r.request_id ? `request ${r.request_id}` : "";
  return row;
}

// ------------------------------------------------------------------ charts

const SVG = "http://www.w3.org/2000/svg";

function drawChart(id, lines, unit) {
  const svg = $(id);
  const end = view.series.length ? view.series[view.series.length - 1].t : 0;
  const start = end - CHART_SECONDS;
  let peak = null; // null: no point at all
  for (const line of lines) for (const [, v] of line.points) if (v !== null) peak = Math.max(peak ?? v, v);
  const top = peak > 0 ? peak * 1.15 : 1;
  const children = [];
  for (const line of lines) {
    const pts = line.points.filter(([, v]) => v !== null)
      .map(([t, v]) => `${(((t - start) / CHART_SECONDS) * 300).toFixed(1)},${(78 - (v / top) * 74).toFixed(1)}`);
    if (!pts.length) continue;
    const poly = document.createElementNS(SVG, "polyline");
    poly.setAttribute("points", pts.length === 1 ? `${pts[0]} ${pts[0]}` : pts.join(" "));
    if (line.second) poly.setAttribute("class", "second");
    children.push(poly);
  }
  svg.replaceChildren(...children);
  // The scale in the caption: text inside a stretched SVG would be stretched too. With
  // nothing drawn there is no scale to tell.
  setText($(`${id}-max`), peak === null ? "" : `max ${Math.round(peak * 10) / 10}${unit}`);
}

function renderCharts() {
  const s = view.series;
  drawChart("chart-tokens", [{ points: s.map((p) => [p.t, p.tokens_per_s]) }], "");
  drawChart("chart-ttft", [{ points: s.map((p) => [p.t, p.ttft_ms]) }], " ms");
  drawChart("chart-queue", [{ points: s.map((p) => [p.t, p.queued]) },
    { points: s.map((p) => [p.t, p.active]), second: true }], "");
  const last = s[s.length - 1];
  const lastTtft = [...s].reverse().find((p) => p.ttft_ms !== null);
  setText($("now-tokens"), last ? `${Math.round(last.tokens_per_s)}` : "");
  setText($("now-ttft"), lastTtft ? `last ${Math.round(lastTtft.ttft_ms)} ms` : "");
  setText($("now-queue"), last ? `${last.queued} · ${last.active}` : "");
}

// ------------------------------------------------------------------ polling

function forgetServer() {
  // Another server answers: its requests count from one again and its series is its own.
  view.seq = 0;
  view.after = 0;
  view.requests = [];
  view.series = [];
  view.status = null;
  $("request-rows").replaceChildren();
  renderCharts();
}

async function poll() {
  view.inFlight = performance.now();
  view.again = false;
  const controller = new AbortController();
  const timer = setTimeout(() => controller.abort(), POLL_TIMEOUT_MS);
  const read = (path) => api(path, { signal: controller.signal });
  try {
    const wantStatus = view.polls % STATUS_EVERY === 0 || !view.status;
    view.polls += 1;
    const [status, models, activity] = await Promise.all([
      wantStatus ? read("/ui/api/status") : null,
      read("/ui/api/models"),
      read(`/ui/api/activity?since=${view.seq}&after=${view.after}`),
    ]);
    if (activity.instance !== view.instance) {
      const restarted = view.instance !== null;
      view.instance = activity.instance;
      if (restarted) {
        // What this poll read was asked of the server before: read it all again, now.
        forgetServer();
        view.again = true;
        return;
      }
    }
    if (status) { view.status = status; view.statusAt = performance.now(); }
    showMain();
    renderStatus();
    renderModels(models);
    renderActivity(activity);
    connection(true, `updated ${new Date().toLocaleTimeString([], { hour12: false })}`);
  } catch (err) {
    if (err instanceof Unauthorized) { keyRefused(err.message, err.key); return; }
    if (err.name === "AbortError") {
      connection(false, `the server has not answered for ${seconds(POLL_TIMEOUT_MS / 1000)}`);
    } else if (err instanceof APIError) {
      // It answered, with an error (shutting down, overloaded, a proxy's 502): that is not
      // a server the page cannot reach.
      const said = err.message === `HTTP ${err.status}` ? "" : `: ${err.message}`;
      connection(false, `the server answered ${err.status}${said}`);
    } else {
      connection(false, `cannot reach the server: ${err.message}`);
    }
  } finally {
    clearTimeout(timer);
    view.inFlight = null;
    if (view.again && view.timer !== null) poll();
  }
}

function tick() {
  // One poll at a time: a server that takes the connection but does not answer (stopped,
  // swapping) is not sent another second's worth of reads every second.
  if (view.inFlight === null) { poll(); return; }
  const waited = performance.now() - view.inFlight;
  if (waited >= SLOW_MS) connection(false, `the server has not answered for ${seconds(waited / 1000)}`);
}

function refresh() {
  // After an action: read now, or as soon as the poll under way ends.
  if (view.inFlight === null) poll();
  else view.again = true;
}

function startPolling() {
  stopPolling();
  view.polls = 0;
  view.timer = setInterval(tick, POLL_MS);
  refresh();
}

function stopPolling() {
  if (view.timer !== null) clearInterval(view.timer);
  view.timer = null;
}

// ------------------------------------------------------------------ playground

const STOP_WAIT_MS = 5000; // Stop waits this long for the server to end the stream itself
const play = { requestId: null, controller: null, cancelTimer: null, dropped: false };

function randomId() {
  const bytes = new Uint8Array(12);
  crypto.getRandomValues(bytes);
  return `ui-${[...bytes].map((b) => b.toString(16).padStart(2, "0")).join("")}`;
}

function renderModelChoices(models) {
  const select = $("model");
  const chat = models.filter((m) => m.kind === "chat" && m.source !== "downloaded");
  const ids = chat.map((m) => m.id);
  const have = [...select.options].map((o) => o.value);
  if (have.join("\n") === ids.join("\n")) return;
  const current = select.value;
  select.replaceChildren(...chat.map((m) => el("option", { value: m.id, text: m.id })));
  const preferred = ids.includes(current) ? current : (chat.find((m) => m.default) || chat[0] || {}).id;
  if (preferred) select.value = preferred;
}

function resetReply() {
  $("output").textContent = "";
  $("reasoning").textContent = "";
  $("reasoning-box").hidden = true;
  $("tool-calls").replaceChildren();
  $("play-error").textContent = "";
  for (const id of ["finish-reason", "usage", "profile", "request-id"]) $(id).textContent = "";
}

function dataURL(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(new Error(`${file.name}: ${reader.error}`));
    reader.readAsDataURL(file);
  });
}

async function playRequest() {
  const messages = [];
  const system = $("system").value;
  if (system.trim()) messages.push({ role: "system", content: system });
  // Images go as OpenAI's image parts after the text, inline (data: URLs): the server
  // reads no file of the page's machine and fetches no URL.
  const images = await Promise.all([...$("images").files].map(dataURL));
  const text = $("prompt").value;
  messages.push({ role: "user", content: images.length === 0 ? text : [
    { type: "text", text }, ...images.map((url) => ({ type: "image_url", image_url: { url } }))] });
  const body = {
    model: $("model").value,
    messages,
    stream: true,
    stream_options: { include_usage: true },
  };
  const temperature = $("temperature").value;
  if (temperature !== "") body.temperature = Number(temperature);
  const maxTokens = $("max-tokens").value;
  if (maxTokens !== "") body.max_tokens = Number(maxTokens);
  const tools = $("tools").value.trim();
  if (tools) {
    let parsed;
    try { parsed = JSON.parse(tools); } catch (err) { throw new Error(`tools: not JSON (${err.message})`); }
    body.tools = Array.isArray(parsed) ? parsed : [parsed];
    body.tool_choice = $("tool-choice").value;
    body.parallel_tool_calls = $("parallel-tool-calls").checked;
  }
  return body;
}

function toolCallItem(index) {
  let item = $("tool-calls").querySelector(`li[data-index="${index}"]`);
  if (!item) {
    item = el("li", { testid: "tool-call" }, el("span", { "class": "name" }), el("pre"));
    item.dataset.index = String(index);
    $("tool-calls").append(item);
    item.rawArguments = "";
  }
  return item;
}

function showArguments(item) {
  let text = item.rawArguments;
  try { text = JSON.stringify(JSON.parse(text), null, 2); } catch (_) { /* still streaming */ }
  item.children[1].textContent = text;
}

function applyChunk(chunk) {
  if (chunk.error) {
    $("play-error").textContent = chunk.error.message || JSON.stringify(chunk.error);
    return;
  }
  if (chunk.afm_profile) { showProfile(chunk.afm_profile); return; }
  if (chunk.usage) showUsage(chunk.usage);
  for (const choice of chunk.choices || []) {
    const delta = choice.delta || {};
    if (delta.reasoning_content) {
      $("reasoning-box").hidden = false;
      $("reasoning").append(delta.reasoning_content);
    }
    if (delta.content) $("output").append(delta.content);
    for (const call of delta.tool_calls || []) {
      const item = toolCallItem(call.index);
      if (call.id) item.dataset.callId = call.id;
      const fn = call.function || {};
      if (fn.name) item.children[0].textContent = fn.name;
      if (fn.arguments) { item.rawArguments += fn.arguments; showArguments(item); }
    }
    if (choice.finish_reason) $("finish-reason").textContent = choice.finish_reason;
  }
}

function showUsage(u) {
  let text = `${u.prompt_tokens} prompt + ${u.completion_tokens} completion = ${u.total_tokens} tokens`;
  const cached = u.prompt_tokens_details && u.prompt_tokens_details.cached_tokens;
  const reasoning = u.completion_tokens_details && u.completion_tokens_details.reasoning_tokens;
  if (cached) text += `, ${cached} cached`;
  if (reasoning) text += `, ${reasoning} reasoning`;
  $("usage").textContent = text;
}

function showProfile(p) {
  const parts = [`queue ${ms(p.queue_ms)}`, `TTFT ${ms(p.ttft_ms)}`, `total ${ms(p.total_ms)}`];
  if (p.prefill_tokens_per_s !== null && p.prefill_tokens_per_s !== undefined) parts.push(`prefill ${Math.round(p.prefill_tokens_per_s)} tok/s`);
  if (p.decode_tokens_per_s !== null && p.decode_tokens_per_s !== undefined) parts.push(`decode ${Math.round(p.decode_tokens_per_s)} tok/s`);
  if (p.peak_memory_bytes) parts.push(`peak ${bytes(p.peak_memory_bytes)}`);
  $("profile").textContent = parts.join(" · ");
  $("profile").dataset.ttftMs = String(p.ttft_ms);
}

function setRunning(running) {
  // Marked, not disabled: the one pressed keeps the focus. (Handing it to the other would
  // turn a second press, Enter twice, into Stop right after Send, or a new Send after Stop.)
  busy($("send"), running);
  busy($("stop"), !running);
  $("output").classList.toggle("running", running);
  // Streamed a token at a time, the reply is read out once it is complete.
  $("output").setAttribute("aria-busy", String(running));
}

async function readStream(response) {
  // Whether the stream ended as the server ends one (with [DONE]).
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return false;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
      const data = block.split(/\r?\n/).filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      if (!data) continue; // a comment (keep-alive)
      if (data === "[DONE]") return true;
      applyChunk(JSON.parse(data));
    }
  }
}

async function send(event) {
  if (event) event.preventDefault();
  if (play.requestId || isBusy($("send"))) return;
  resetReply();
  if (!$("model").value) { $("play-error").textContent = "No chat model to send to."; return; }
  let body;
  try { body = await playRequest(); } catch (err) { $("play-error").textContent = err.message; return; }
  const requestId = randomId();
  play.requestId = requestId;
  play.controller = new AbortController();
  $("request-id").textContent = requestId;
  setRunning(true);
  const key = apiKey();
  let replying = false; // the server has answered: a failure now cuts the reply off
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers({ "Content-Type": "application/json", "X-Request-ID": requestId,
        "X-AFM-Profile": "true" }),
      body: JSON.stringify(body),
      signal: play.controller.signal,
      cache: "no-store",
    });
    if (!response.ok) {
      const refusal = (await errorOf(response)).message;
      if (response.status === 401 && keyRefused(refusal, key)) return;
      $("play-error").textContent = refusal;
      return;
    }
    replying = true;
    if (!(await readStream(response)) && !$("play-error").textContent) {
      $("play-error").textContent = "The reply ended before the server finished it.";
    }
  } catch (err) {
    // The browser's own words ("network error", "Failed to fetch") say little of what
    // happened: the server went away mid-reply, or could not be reached at all.
    if (err.name === "AbortError") {
      // Stop's own fallback: the server (hung, stopped) never ended the stream. Without a
      // word the reply would look finished, with neither a finish reason nor an error.
      if (play.dropped) {
        $("play-error").textContent = `The server did not end the reply within ${seconds(STOP_WAIT_MS / 1000)} `
          + "of Stop: the page dropped the connection, which cancels the request when the server "
          + "reads again.";
      }
    } else {
      $("play-error").textContent = replying
        ? `The connection to the server was lost mid-reply (${err.message}).`
        : `The page cannot reach the server (${err.message}).`;
    }
  } finally {
    clearTimeout(play.cancelTimer);
    play.dropped = false;
    play.requestId = null;
    play.controller = null;
    setRunning(false);
  }
}

async function stop() {
  const requestId = play.requestId;
  if (!requestId || isBusy($("stop"))) return;
  busy($("stop"), true); // pressed once; it keeps the focus until the reply ends
  // The server ends the stream itself (finish_reason "cancelled"); should it not, within a
  // few seconds, the connection is dropped, which cancels the generation too.
  play.cancelTimer = setTimeout(() => {
    if (play.controller) { play.dropped = true; play.controller.abort(); }
  }, STOP_WAIT_MS);
  try {
    const response = await fetch(`/v1/chat/completions/${encodeURIComponent(requestId)}/cancel`, {
      method: "POST", headers: headers(), cache: "no-store",
    });
    if (response.status === 404 && play.controller) play.controller.abort(); // already over
    else if (!response.ok) $("play-error").textContent = (await errorOf(response)).message;
  } catch (err) {
    $("play-error").textContent = err.message;
  }
}

// ------------------------------------------------------------------ start

function saveKey(event) {
  event.preventDefault();
  const key = $("api-key").value.trim();
  if (!key) return;
  const refused = unsendable(key);
  if (refused) { showKeyPanel(refused); return; }
  sessionStorage.setItem(KEY_STORAGE, key);
  $("api-key").value = "";
  $("key-error").textContent = "checking…";
  startPolling();
}

document.addEventListener("DOMContentLoaded", () => {
  $("key-form").addEventListener("submit", saveKey);
  $("pull-form").addEventListener("submit", startPull);
  $("play-form").addEventListener("submit", send);
  $("stop").addEventListener("click", stop);
  // Escape in the playground stops a running reply, as in chat apps (the Stop button is
  // one Tab away, or more from the prompt).
  $("play-form").addEventListener("keydown", (e) => {
    if (e.key === "Escape" && play.requestId) { e.preventDefault(); stop(); }
  });
  $("prompt").addEventListener("keydown", (e) => {
    // As the Send button: through the form's own checks (a prompt, numbers in range).
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); $("play-form").requestSubmit(); }
  });
  setInterval(() => { if (!view.lost) renderStatus(); }, 1000); // the uptime ticks between reads
  boot();
});

async function boot() {
  const kept = unsendable(apiKey());
  if (kept) { sessionStorage.removeItem(KEY_STORAGE); showKeyPanel(kept); return; }
  // Whether a key is needed is public: without one, ask for it before reading anything.
  try {
    const auth = await (await fetch("/ui/auth", { cache: "no-store" })).json();
    if (auth.api_key_required && !apiKey()) { showKeyPanel(""); return; }
  } catch (err) {
    connection(false, `cannot reach the server: ${err.message}`);
  }
  startPolling();
}
