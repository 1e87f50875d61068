// The dashboard: live state from /dashboard/api/events, rendered into the page's tables.

import { call, explain, key, sse } from "./api.js";
import { colour, drawLines } from "./charts.js";
import { fillModels, fillVoices, setupPlayground } from "./playground.js";

const $ = (id) => document.getElementById(id);
let order = []; // model names in first-seen order: stable chart colours
let latest = null;

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

const seconds = (s) => (s === null || s === undefined ? "–" : s < 1 ? `${Math.round(s * 1000)} ms` : `${s.toFixed(2)} s`);

function duration(s) {
  if (s === null || s === undefined) return "–";
  if (s < 90) return `${Math.round(s)} s`;
  if (s < 5400) return `${Math.round(s / 60)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

function cell(row, content, className) {
  const td = row.insertCell();
  if (content instanceof Node) td.append(content);
  else td.textContent = content ?? "–";
  if (className) td.className = className;
  return td;
}

// Replace a cell's content only when it changed (`sig`): rows stay in place between updates,
// so a focused button keeps its focus and a click never lands on a replaced element.
function update(td, sig, build) {
  if (td.dataset.sig === sig) return;
  td.dataset.sig = sig;
  const content = build();
  if (content instanceof Node) td.replaceChildren(content);
  else td.textContent = content ?? "–";
}

const text = (value) => [String(value ?? "–"), () => value];

// A long source (pkg://module/file.gguf) may wrap after each "/" rather than mid-word.
function breakable(source) {
  const span = document.createElement("span");
  String(source ?? "–").split("/").forEach((part, i) => {
    if (i) span.append("/", document.createElement("wbr"));
    span.append(part);
  });
  return span;
}

function memory(model, budget) {
  const span = document.createElement("span");
  const used = model.rss_bytes ?? model.memory_bytes;
  if (used === undefined || used === null) { span.textContent = "–"; return span; }
  // RSS when the model runs in a worker process; otherwise the loader's estimate.
  const what = `${model.rss_bytes != null ? "RSS" : "est."} ${bytes(used)}${budget ? ` / ${bytes(budget)}` : ""}`;
  const label = `${what}${model.pid != null ? ` · pid ${model.pid}` : ""}`;
  if (budget) {
    const meter = document.createElement("meter");
    meter.min = 0; meter.max = budget; meter.value = used; meter.high = budget * 0.9;
    meter.setAttribute("aria-label", `${model.name} memory of budget`);
    span.append(meter, ` ${label}`);
  } else {
    span.textContent = label;
  }
  return span;
}

function cacheHits(cache) {
  if (!cache || !cache.hits) return "–";
  const hits = cache.hits, total = Object.values(hits).reduce((a, b) => a + b, 0) + (cache.misses || 0);
  if (!total) return "no lookups";
  return Object.entries(hits).map(([tier, n]) => `${tier} ${Math.round((100 * n) / total)}%`).join(" · ");
}

function idleLeft(model) {
  if (model.state !== "loaded" || model.idle_ttl_s === null || model.idle_ttl_s === undefined) return "–";
  return model.idle_s > 0 ? duration(Math.max(model.idle_ttl_s - model.idle_s, 0)) : `${duration(model.idle_ttl_s)} (busy)`;
}

function actionButton(label, name, verb) {
  const button = document.createElement("button");
  button.type = "button";
  button.textContent = label;
  button.setAttribute("aria-label", `${label} ${name}`);
  button.addEventListener("click", () => act(`/admin/models/${encodeURIComponent(name)}/${verb}`, `${verb} ${name}`, button));
  return button;
}

const MODEL_COLUMNS = ["state", "actions", "kind", "aliases", "source", "dtype", "memory", "queue",
  "running", "tps", "ttft", "cache", "restarts", "idle"];

function modelRow(name) {
  const row = document.createElement("tr");
  row.dataset.model = name;
  const th = document.createElement("th");
  th.scope = "row";
  th.textContent = name;
  row.append(th);
  for (const column of MODEL_COLUMNS) cell(row, "", column === "source" ? "source" : "").dataset.field = column;
  return row;
}

function stateCell(model) {
  const span = document.createElement("span");
  span.append(model.state);
  if (model.state === "unloaded") {
    // Declared but not in memory: the next request loads it (a lazy model waits for one).
    const note = Object.assign(document.createElement("small"), { className: "muted" });
    note.textContent = model.load === "lazy" ? " lazy" : "";
    span.title = "loads on its next request";
    span.append(note);
  }
  if (model.error) span.append(document.createElement("br"), Object.assign(document.createElement("small"), { textContent: model.error }));
  return span;
}

function actionsCell(name, model) {
  const span = document.createElement("span");
  const loaded = ["loaded", "loading", "restarting"].includes(model.state);
  if (model.state !== "draining") {
    span.append(loaded ? actionButton("Unload", name, "unload") : actionButton("Load", name, "load"));
  }
  return span;
}

function dtypeCell(model) {
  // On the CPU, the weights' path chosen at load (packed / float32 / mixed) and its timings.
  const span = document.createElement("span");
  span.append(model.dtype ?? "–");
  if (model.cpu_path) {
    const path = Object.assign(document.createElement("small"), { className: "muted cpu-path" });
    path.textContent = ` ${model.cpu_path.plan}`;
    span.title = model.cpu_path.summary;
    span.append(document.createElement("br"), path);
  }
  return span;
}

function renderModels(status) {
  const body = $("models").tBodies[0];
  const names = Object.keys(status.models);
  for (const row of [...body.rows]) if (!names.includes(row.dataset.model)) row.remove();
  names.forEach((name, index) => {
    const model = status.models[name];
    const row = [...body.rows].find((r) => r.dataset.model === name) || modelRow(name);
    if (body.rows[index] !== row) body.insertBefore(row, body.rows[index] || null);
    const td = Object.fromEntries([...row.cells].slice(1).map((c) => [c.dataset.field, c]));
    td.state.className = `state state-${model.state}${model.error ? " error-text" : ""}`;
    update(td.state, `${model.state}|${model.error}|${model.load}`, () => stateCell(model));
    const verb = model.state === "draining" ? "" : ["loaded", "loading", "restarting"].includes(model.state) ? "unload" : "load";
    update(td.actions, verb, () => actionsCell(name, model));
    update(td.kind, ...text(model.kind));
    update(td.aliases, ...text((model.aliases || []).join(", ") || "–"));
    update(td.source, model.source, () => breakable(model.source));
    update(td.dtype, `${model.dtype}|${model.cpu_path?.summary}`, () => dtypeCell(model));
    const used = model.rss_bytes ?? model.memory_bytes;
    update(td.memory, `${used}|${model.pid}|${status.memory_budget}`, () => memory({ ...model, name }, status.memory_budget));
    update(td.queue, ...text(model.queue_depth));
    update(td.running, ...text(model.running));
    update(td.tps, ...text(model.tokens_per_s));
    update(td.ttft, ...text(`${seconds(model.ttft_p50_s)} / ${seconds(model.ttft_p95_s)}`));
    update(td.cache, ...text(cacheHits(model.cache)));
    update(td.restarts, ...text(model.restarts ?? 0));
    update(td.idle, ...text(idleLeft(model)));
  });
}

function renderConfig(config) {
  // No file: the daemon serves the embedded default config (nothing to watch or reload).
  $("config-path").textContent = config.path === "None" ? "built-in default (no file)" : config.path;
  $("config-generation").textContent = config.generation;
  $("config-loaded").textContent = config.loaded_at ? new Date(config.loaded_at * 1000).toLocaleString() : "–";
  const actions = config.last_actions || [];
  $("config-actions").replaceChildren(...(actions.length ? actions : ["nothing to change"]).map((text) =>
    Object.assign(document.createElement("li"), { textContent: text })));
  const error = $("config-error");
  error.hidden = !config.last_error;
  error.textContent = config.last_error || "";
}

function renderCharts(history) {
  const now = Date.now() / 1000;
  for (const name of Object.keys(history.models)) if (!order.includes(name)) order.push(name);
  const pick = (field) => Object.fromEntries(Object.entries(history.models).map(([m, samples]) =>
    [m, samples.map((s) => ({ at: s.at, value: s[field] }))]));
  drawLines($("chart-tps"), pick("tokens_per_s"), order, now);
  drawLines($("chart-queue"), pick("queue_depth"), order, now);
  $("chart-legend").replaceChildren(...Object.keys(history.models).map((name) => {
    const li = document.createElement("li");
    const swatch = document.createElement("span");
    swatch.style.background = colour(order.indexOf(name));
    li.append(swatch, name);
    return li;
  }));
}

function renderRequests(lines) {
  const filter = $("log-model").value;
  const body = $("requests").tBodies[0];
  body.replaceChildren();
  for (const line of lines) {
    if (filter && line.model !== filter) continue;
    const row = body.insertRow();
    row.dataset.model = line.model || "";
    cell(row, new Date(line.at * 1000).toLocaleTimeString());
    cell(row, line.request_id);
    cell(row, line.model);
    cell(row, line.endpoint);
    cell(row, line.status);
    cell(row, `${line.prompt_tokens} / ${line.completion_tokens}`);
    cell(row, line.ttft_ms == null ? "–" : `${line.ttft_ms} ms`);
    cell(row, `${line.duration_ms} ms`);
    cell(row, line.error || "", "error-text");
  }
}

function render(state) {
  latest = state;
  const { status } = state;
  $("health").textContent = "up " + duration(status.uptime_s);
  $("health").className = "badge ok";
  $("platform").textContent = status.platform;
  const spare = status.spare_worker;
  $("spare").textContent = spare ? `worker ready for the next load (pid ${spare.pid}, ${bytes(spare.rss_bytes)})` : "";
  renderModels(status);
  renderConfig(status.config);
  renderCharts(state.history);
  renderRequests(state.requests);
  const models = Object.entries(status.models).filter(([, m]) => m.state !== "draining");
  const ids = (kinds) => models.filter(([, m]) => kinds.includes(m.kind)).flatMap(([n, m]) => [n, ...(m.aliases || [])]);
  fillModels($("chat-model"), ids(["llm", "vlm"]));
  fillModels($("embed-model"), ids(["embedding"]));
  fillModels($("transcribe-model"), ids(["stt"]));
  fillModels($("speak-model"), ids(["tts"]));
  fillVoices(status.models);
  const logSelect = $("log-model");
  const choice = logSelect.value;
  const names = Object.keys(status.models);
  if (logSelect.options.length !== names.length + 1 || names.some((n, i) => logSelect.options[i + 1].value !== n)) {
    logSelect.replaceChildren(new Option("all models", ""), ...names.map((n) => new Option(n, n)));
    logSelect.value = names.includes(choice) ? choice : "";
  }
}

let askedForKey = false;
function showAuth(message) {
  const notice = $("auth-notice");
  notice.hidden = !message;
  notice.textContent = message || "";
  if (message && !askedForKey) {
    askedForKey = true; // ask once: put the cursor in the key field, then leave the user be
    $("key-input").focus();
  }
  if (message) {
    $("health").textContent = "no access";
    $("health").className = "badge degraded";
  }
}

async function act(path, what, button) {
  const result = $("action-result");
  result.textContent = `${what}…`;
  if (button) button.disabled = true;
  try {
    const answer = await call(path, { method: "POST" });
    result.textContent = answer.actions
      ? `reloaded: ${answer.actions.length ? answer.actions.join("; ") : "nothing to change"}`
      : `${answer.model}: ${answer.state}`;
  } catch (error) {
    result.textContent = `Refused (${what}): ${explain(error)}`;
    if (error.status === 401 || error.status === 403) showAuth(explain(error));
  } finally {
    if (button) button.disabled = false;
    refresh();
  }
}

async function refresh() {
  try {
    render(await call("/dashboard/api/state"));
    showAuth(null);
  } catch (error) {
    if (error.status === 401 || error.status === 403) showAuth(explain(error));
  }
}

// Live updates: the SSE stream; on a refusal or a dropped connection, retry every 2 s.
let live = null;
async function follow() {
  live?.abort();
  const controller = (live = new AbortController());
  while (!controller.signal.aborted) {
    try {
      for await (const data of sse("/dashboard/api/events", { signal: controller.signal })) {
        render(JSON.parse(data));
        showAuth(null);
      }
    } catch (error) {
      if (controller.signal.aborted) return;
      if (error.status === 401 || error.status === 403) {
        showAuth(explain(error));
      } else {
        $("health").textContent = "unreachable";
        $("health").className = "badge draining";
      }
    }
    await new Promise((resolve) => setTimeout(resolve, 2000));
  }
}

function setupKey() {
  $("key-input").value = key.get();
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    key.set($("key-input").value.trim());
    $("action-result").textContent = key.get() ? "key saved for this browser session" : "key cleared";
    follow();
  });
  $("key-forget").addEventListener("click", () => {
    key.set("");
    $("key-input").value = "";
    $("action-result").textContent = "key cleared";
    follow();
  });
}

setupKey();
setupPlayground();
$("reload").addEventListener("click", () => act("/admin/reload", "reload", $("reload")));
$("log-model").addEventListener("change", () => latest && renderRequests(latest.requests));
follow();
