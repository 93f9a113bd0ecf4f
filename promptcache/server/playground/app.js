// promptcache playground: plain JS, no build step, no network beyond this server.
"use strict";

const $ = (id) => document.getElementById(id);
const keyInput = $("api-key"), metricsKeyInput = $("metrics-key");
keyInput.value = sessionStorage.getItem("promptcache-api-key") || "";
metricsKeyInput.value = sessionStorage.getItem("promptcache-metrics-key") || "";
keyInput.addEventListener("change", () => sessionStorage.setItem("promptcache-api-key", keyInput.value));
metricsKeyInput.addEventListener("change", () => sessionStorage.setItem("promptcache-metrics-key", metricsKeyInput.value));

function headers(key = keyInput.value) {
  const h = { "content-type": "application/json" };
  if (key) h.authorization = "Bearer " + key;
  return h;
}

async function api(path, options = {}) {
  const response = await fetch(path, { ...options, headers: headers() });
  if (response.status === 204) return null;
  const body = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error((body.error && body.error.message) || response.statusText);
  return body;
}

// Server-sent events of a streamed POST: calls onChunk with each parsed JSON payload.
async function stream(path, body, onChunk) {
  const response = await fetch(path, { method: "POST", headers: headers(), body: JSON.stringify(body) });
  if (!response.ok) {
    const error = await response.json().catch(() => ({}));
    throw new Error((error.error && error.error.message) || response.statusText);
  }
  const reader = response.body.getReader(), decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const line = buffer.slice(0, cut).trim();
      buffer = buffer.slice(cut + 2);
      if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
      const chunk = JSON.parse(line.slice(6));
      if (chunk.error) throw new Error(chunk.error.message);
      onChunk(chunk);
    }
  }
}

const escapeXml = (text) => text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");

// -- tabs ---------------------------------------------------------------------------------------
document.querySelectorAll("nav button").forEach((button) => button.addEventListener("click", () => {
  document.querySelectorAll("nav button").forEach((b) => b.classList.toggle("active", b === button));
  document.querySelectorAll(".tab").forEach((tab) => { tab.hidden = tab.id !== "tab-" + button.dataset.tab; });
}));

// -- schemas ------------------------------------------------------------------------------------
let current = null;

async function loadSchemas() {
  const list = $("schema-list");
  list.textContent = "";
  const { data } = await api("/v1/schemas");
  for (const info of data) {
    const item = document.createElement("li");
    const open = document.createElement("button");
    open.textContent = info.name;
    open.className = "schema-open";
    open.addEventListener("click", () => selectSchema(info));
    const remove = document.createElement("button");
    remove.textContent = "delete";
    remove.addEventListener("click", async () => { await api("/v1/schemas/" + info.name, { method: "DELETE" }); loadSchemas(); });
    item.append(open, " ", `${info.num_tokens} positions `, remove);
    list.append(item);
  }
  if (data.length && !current) selectSchema(data[0]);
}

// Where a top-level module's KV is now: explain a prompt importing it alone.
async function tierOf(schema, path) {
  if (path.includes(".")) return null;
  const explained = await api("/v1/prompts/explain", { method: "POST",
    body: JSON.stringify({ prompt: `<prompt schema="${schema}"><${path}/></prompt>` }) });
  const module = explained.modules.find((m) => m.path === path);
  return module ? module.tier : null;
}

async function selectSchema(info) {
  current = info;
  $("layout-name").textContent = `${info.name} (${info.num_tokens} positions; scaffolds: ${
    info.scaffolds.map((s) => s.join("+")).join(", ") || "none"})`;
  const layout = $("layout");
  layout.textContent = "";
  const rows = [];  // modules that overlap (union members, nested modules) stack on lower rows
  for (const module of info.modules) {
    let row = 0;
    while ((rows[row] || []).some((m) => m.start < module.end && module.start < m.end)) row++;
    (rows[row] = rows[row] || []).push(module);
    const block = document.createElement("div");
    const tier = await tierOf(info.name, module.path).catch(() => null);
    if (current !== info) return;  // another schema was selected meanwhile: it draws the layout
    block.className = "block tier-" + (tier || "none");
    block.dataset.path = module.path;
    block.title = `${module.path}: positions ${module.start}-${module.end}, KV in ${tier || "no tier"}`;
    block.style.left = (100 * module.start / info.num_tokens) + "%";
    block.style.width = Math.max(0.5, 100 * (module.end - module.start) / info.num_tokens) + "%";
    block.style.top = (row * 1.7) + "rem";
    block.textContent = module.path;
    layout.append(block);
    for (const param of module.params || []) {  // parameter slots: hatched, inside their module's row
      const slot = document.createElement("div");
      slot.className = "block param";
      slot.dataset.param = module.path + "." + param.name;
      slot.title = "param " + param.name + ": " + param.length + " positions from " + param.start;
      slot.style.left = (100 * param.start / info.num_tokens) + "%";
      slot.style.width = Math.max(0.5, 100 * param.length / info.num_tokens) + "%";
      slot.style.top = (row * 1.7 + 0.9) + "rem";
      slot.style.height = "0.7rem";
      layout.append(slot);
    }
  }
  const picks = $("module-picks");
  picks.textContent = "";
  for (const module of info.modules.filter((m) => !m.path.includes("."))) {
    const label = document.createElement("label");
    const box = document.createElement("input");
    box.type = "checkbox"; box.checked = true; box.value = module.path; box.style.width = "auto";
    box.addEventListener("change", compose);
    label.append(box, " " + module.path + " ");
    for (const param of module.params || []) {  // an argument for each of the module's parameters
      const value = document.createElement("input");
      value.className = "param-value"; value.dataset.module = module.path; value.dataset.param = param.name;
      value.placeholder = param.name + " (<= " + param.length + " tokens)"; value.style.width = "10rem";
      value.addEventListener("input", compose);
      label.append(value, " ");
    }
    picks.append(label);
  }
  compose();
}

function compose() {
  if (!current) return;
  const argument = (path) => [...document.querySelectorAll('#module-picks .param-value[data-module="' + path + '"]')]
    .filter((input) => input.value)
    .map((input) => " " + input.dataset.param + '="' + escapeXml(input.value).replace(/"/g, "&quot;") + '"').join("");
  const imports = [...document.querySelectorAll("#module-picks input:checked")]
    .map((b) => "<" + b.value + argument(b.value) + "/>").join("");
  $("pml-prompt").value = `<prompt schema="${current.name}">${imports}${escapeXml($("free-text").value)}</prompt>`;
}
$("free-text").addEventListener("input", compose);

$("upload").addEventListener("click", async () => {
  const error = $("upload-error");
  error.hidden = true;
  try {
    const info = await api("/v1/schemas", { method: "POST", body: JSON.stringify({ pml: $("pml-editor").value }) });
    current = info;  // so the list reload does not select another schema meanwhile
    await loadSchemas();
    await selectSchema(info);
  } catch (exc) {
    error.hidden = false;
    error.textContent = exc.message;
    const line = /line (\d+)/.exec(exc.message);
    if (line) {  // put the cursor on the line the error names
      const editor = $("pml-editor"), lines = editor.value.split("\n");
      const start = lines.slice(0, Number(line[1]) - 1).join("\n").length + (Number(line[1]) > 1 ? 1 : 0);
      editor.focus();
      editor.setSelectionRange(start, start + (lines[Number(line[1]) - 1] || "").length);
      error.dataset.line = line[1];
    }
  }
});

$("explain").addEventListener("click", async () => {
  try {
    const e = await api("/v1/prompts/explain", { method: "POST", body: JSON.stringify({ prompt: $("pml-prompt").value }) });
    $("explanation").textContent = `${e.prompt_tokens} prompt tokens: ${e.cached_tokens} cached, ${e.tokens_to_compute} to compute; ` +
      `${e.exact ? "exact" : "approximate (" + e.approximations.join("; ") + ")"}, fidelity ${e.fidelity}`;
  } catch (exc) { $("explanation").textContent = exc.message; }
});

function drawSpans(final) {
  const spans = $("spans");
  spans.textContent = "";
  const add = (label, cls) => { const s = document.createElement("span"); s.className = cls; s.textContent = label; spans.append(s); };
  for (const m of final.cache.modules) {
    add(`${m.path}: ${m.num_tokens} tok from ${m.tier}`, "tier-" + (m.tier === "computed" ? "computed" : m.tier));
    if (m.recomputed_tokens) add(`${m.path}: ${m.recomputed_tokens} recomputed`, "tier-recomputed");
  }
  if (final.cache.prefix) add(`prefix blocks: ${final.cache.prefix.num_tokens} tok`, "tier-prefix");
  add(`computed now: ${final.usage.computed_tokens} tok`, "tier-computed");
}

$("run").addEventListener("click", async () => {
  $("output").textContent = ""; $("stats").textContent = ""; $("spans").textContent = "";
  const started = performance.now();
  let first = null, tokens = 0;
  try {
    await stream("/v1/generate", { prompt: $("pml-prompt").value, stream: true, max_tokens: 32, temperature: 0 }, (chunk) => {
      for (const choice of chunk.choices || []) {
        if (choice.text) { if (first === null) first = performance.now() - started; tokens++; $("output").textContent += choice.text; }
      }
      if (chunk.usage) {
        drawSpans(chunk);
        const seconds = (performance.now() - started) / 1000;
        $("stats").textContent = `TTFT ${first === null ? "-" : first.toFixed(0)} ms (server ${chunk.timings.ttft_ms.toFixed(1)} ms), ` +
          `${(chunk.usage.completion_tokens / seconds).toFixed(1)} tokens/s, ${chunk.usage.cached_tokens} of ${chunk.usage.prompt_tokens} ` +
          `prompt tokens cached, ${chunk.cache.exact ? "exact" : "approximate: " + chunk.cache.approximations.join("; ")}`;
        if (current) selectSchema(current);  // tiers may have changed
      }
    });
  } catch (exc) { $("output").textContent = exc.message; }
});

// -- chat ---------------------------------------------------------------------------------------
const messages = [];
$("chat-send").addEventListener("click", async () => {
  const text = $("chat-input").value;
  if (!text) return;
  $("chat-input").value = "";
  messages.push({ role: "user", content: text });
  const log = $("chat-log");
  const user = document.createElement("div"); user.textContent = "you: " + text; log.append(user);
  const reply = document.createElement("div"); reply.className = "assistant"; reply.textContent = "assistant: "; log.append(reply);
  let content = "";
  try {
    await stream("/v1/chat/completions", { messages, stream: true, max_tokens: 24, temperature: 0,
      stream_options: { include_usage: true } }, (chunk) => {
      for (const choice of chunk.choices || []) {
        const piece = (choice.delta && choice.delta.content) || "";
        content += piece; reply.textContent += piece;
      }
      if (chunk.usage) {
        const note = document.createElement("div"); note.className = "reuse";
        note.textContent = `turn ${messages.filter((m) => m.role === "user").length}: ` +
          `${chunk.usage.prompt_tokens_details.cached_tokens} of ${chunk.usage.prompt_tokens} prompt tokens reused`;
        log.append(note);
      }
    });
    messages.push({ role: "assistant", content });
  } catch (exc) { reply.textContent += " [" + exc.message + "]"; }
});

// -- live metrics -------------------------------------------------------------------------------
function metricSum(text, name) {
  return text.split("\n").filter((line) => line.startsWith(name + "{") || line.startsWith(name + " "))
    .reduce((sum, line) => sum + Number(line.trim().split(" ").pop()), 0);
}

async function pollMetrics() {
  const error = $("metrics-error");
  try {
    const response = await fetch("/metrics", { headers: headers(metricsKeyInput.value) });
    if (response.status === 401) throw new Error("/metrics needs the metrics key");
    const text = await response.text();
    const prompt = metricSum(text, "promptcache:prompt_tokens_total");
    const cached = metricSum(text, "promptcache:cached_prompt_tokens_total");
    const ttftSum = metricSum(text, "promptcache:time_to_first_token_seconds_sum");
    const ttftCount = metricSum(text, "promptcache:time_to_first_token_seconds_count");
    const row = document.createElement("tr");
    row.innerHTML = `<td>${new Date().toLocaleTimeString()}</td><td>${prompt ? (100 * cached / prompt).toFixed(1) + "%" : "-"}</td>` +
      `<td>${ttftCount ? (1000 * ttftSum / ttftCount).toFixed(0) + " ms" : "-"}</td>`;
    const table = $("metrics");
    table.insertBefore(row, table.rows[1] || null);
    while (table.rows.length > 13) table.deleteRow(13);
    error.hidden = true;
  } catch (exc) { error.hidden = false; error.textContent = exc.message; }
}

loadSchemas().catch((exc) => { $("upload-error").hidden = false; $("upload-error").textContent = exc.message; });
pollMetrics();
setInterval(pollMetrics, 3000);
