// promptcache playground: plain JS, no build step, no network beyond this server.
"use strict";

const $ = (id) => document.getElementById(id);
const keyInput = $("api-key"), metricsKeyInput = $("metrics-key");
keyInput.value = sessionStorage.getItem("promptcache-api-key") || "";
metricsKeyInput.value = sessionStorage.getItem("promptcache-metrics-key") || "";
// A new key is another tenant's view (or the first that gets in): keep it, then reload the schemas.
let keyTimer = null;
keyInput.addEventListener("input", () => {
  sessionStorage.setItem("promptcache-api-key", keyInput.value);
  clearTimeout(keyTimer);
  keyTimer = setTimeout(reloadSchemas, 300);
});
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
  if (!response.ok) {
    const error = new Error((body.error && body.error.message) || response.statusText);
    error.status = response.status;
    throw error;
  }
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
  const { data } = await api("/v1/schemas");
  list.textContent = "";
  if (current && !data.some((info) => info.name === current.name)) {  // another key: another tenant's schemas
    current = null;
    $("layout").textContent = ""; $("layout-name").textContent = ""; $("module-picks").textContent = "";
  }
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

// The schema list again, its error (a 401 before the key was typed) cleared or shown with what to do.
async function reloadSchemas() {
  const error = $("schema-error");
  try {
    await loadSchemas();
    error.hidden = true;
  } catch (exc) {
    error.hidden = false;
    error.textContent = exc.status === 401 ? exc.message + ": type your API key above" : exc.message;
  }
}

// A module and the modules enclosing it, outermost first (a path is its names joined by dots; union
// levels are transparent, so a union member's parent is the union's enclosing module).
function lineage(byPath, path) {
  const chain = [];
  for (let module = byPath[path]; module; ) {
    chain.unshift(module);
    module = module.path === module.name ? null : byPath[module.path.slice(0, -(module.name.length + 1))];
  }
  return chain;
}

// The PML that imports `paths`, nested as in the schema: <outer><inner/></outer>. `attributes(path)`
// returns the arguments to write on a module's tag.
function importXml(info, paths, attributes = () => "") {
  const byPath = Object.fromEntries(info.modules.map((m) => [m.path, m]));
  const tree = new Map();  // name -> [path, children]
  for (const path of paths) {
    let level = tree;
    for (const module of lineage(byPath, path)) {
      if (!level.has(module.name)) level.set(module.name, [module.path, new Map()]);
      level = level.get(module.name)[1];
    }
  }
  const xml = (level) => [...level].map(([name, [path, children]]) => children.size
    ? `<${name}${attributes(path)}>${xml(children)}</${name}>` : `<${name}${attributes(path)}/>`).join("");
  return xml(tree);
}

const TIER_RANK = ["device", "host", "redis", "disk", "computed"];

// Where the KV of these modules is now (the slowest of them; null: some would be computed), read with a
// dry-run explain of a prompt that imports them. Importing every module of a scaffold uses its jointly
// encoded KV, so this also answers where a scaffold's KV is.
async function tierOf(info, paths) {
  const explained = await api("/v1/prompts/explain", { method: "POST",
    body: JSON.stringify({ prompt: `<prompt schema="${info.name}">${importXml(info, paths)}</prompt>` }) });
  const tiers = paths.map((path) => (explained.modules.find((m) => m.path === path) || {}).tier || null);
  if (tiers.includes(null)) return null;
  return tiers.reduce((a, b) => (TIER_RANK.indexOf(a) >= TIER_RANK.indexOf(b) ? a : b));
}

// Rows of a layout: an item goes on the first row (from `first`) where it overlaps nothing.
function placeRow(rows, item, first = 0) {
  let row = first;
  while ((rows[row] || []).some((m) => m.start < item.end && item.start < m.end)) row++;
  (rows[row] = rows[row] || []).push(item);
  return row;
}

function layoutBlock(info, className, start, end, row, label, title) {
  const block = document.createElement("div");
  block.className = className;
  block.title = title;
  block.style.left = (100 * start / info.num_tokens) + "%";
  block.style.width = Math.max(0.5, 100 * (end - start) / info.num_tokens) + "%";
  block.style.top = (row * 1.7) + "rem";
  block.textContent = label;
  return block;
}

// The schema's layout to scale, each module and scaffold coloured by where its KV is now.
async function drawLayout(info) {
  const byPath = Object.fromEntries(info.modules.map((m) => [m.path, m]));
  const scaffolds = info.scaffolds.map((paths) => ({ paths, start: Math.min(...paths.map((p) => byPath[p].start)),
    end: Math.max(...paths.map((p) => byPath[p].end)) }));
  const [moduleTiers, scaffoldTiers] = await Promise.all([
    Promise.all(info.modules.map((m) => tierOf(info, [m.path]).catch(() => null))),
    Promise.all(scaffolds.map((s) => tierOf(info, s.paths).catch(() => null)))]);
  if (current !== info) return;  // another schema was selected meanwhile: it draws the layout
  const layout = $("layout");
  layout.textContent = "";
  const rows = [];  // modules that overlap (union members, nested modules) stack on lower rows
  for (const [start, end] of info.always_included || []) {  // system prompt, role tags: in every prompt
    const block = layoutBlock(info, "block always", start, end, placeRow(rows, { start, end }), "always",
      `always included (every prompt): positions ${start}-${end}`);
    block.dataset.always = `${start}-${end}`;
    layout.append(block);
  }
  info.modules.forEach((module, i) => {
    const row = placeRow(rows, module), tier = moduleTiers[i];
    const block = layoutBlock(info, "block tier-" + (tier || "none"), module.start, module.end, row, module.path,
      `${module.path}: positions ${module.start}-${module.end}, KV in ${tier || "no tier"}`);
    block.dataset.path = module.path;
    layout.append(block);
    for (const param of module.params || []) {  // parameter slots: hatched, inside their module's row
      const slot = layoutBlock(info, "block param", param.start, param.start + param.length, row, "",
        "param " + param.name + ": " + param.length + " positions from " + param.start);
      slot.dataset.param = module.path + "." + param.name;
      slot.style.top = (row * 1.7 + 0.9) + "rem";
      slot.style.height = "0.7rem";
      layout.append(slot);
    }
  });
  const moduleRows = rows.length;
  scaffolds.forEach((scaffold, i) => {  // a bracket under the modules it spans, on rows of their own
    const row = placeRow(rows, scaffold, moduleRows), tier = scaffoldTiers[i];
    const block = layoutBlock(info, "block scaffold tier-" + (tier || "none"), scaffold.start, scaffold.end, row,
      "scaffold: " + scaffold.paths.join(" + "),
      `scaffold ${scaffold.paths.join(" + ")}: encoded jointly, used when a prompt imports all of them; ` +
      `positions ${scaffold.start}-${scaffold.end}, KV in ${tier || "no tier"}`);
    block.dataset.scaffold = scaffold.paths.join(" ");
    layout.append(block);
  });
  layout.style.height = Math.max(3, rows.length * 1.7 + 0.2) + "rem";
}

// One tick box per module (nested ones indented, unticked) with an argument field per parameter.
function drawPicks(info) {
  const byPath = Object.fromEntries(info.modules.map((m) => [m.path, m]));
  const picks = $("module-picks");
  picks.textContent = "";
  const starts = new Set();  // members of one union share their start: only the first is ticked
  for (const module of info.modules) {
    const depth = lineage(byPath, module.path).length - 1;
    const label = document.createElement("label");
    label.className = "pick";
    label.style.marginLeft = (depth * 1.2) + "rem";
    const box = document.createElement("input");
    box.type = "checkbox"; box.checked = depth === 0 && !starts.has(module.start); box.value = module.path;
    box.style.width = "auto";
    if (depth === 0) starts.add(module.start);
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
}

// Questions that fit the bundled example schemas; any other schema starts with a generic one.
const EXAMPLE_QUESTIONS = { library: "Into which ocean does the Amazon flow?",
  "trip-planner": "Plan the days and highlight the food." };
const GENERIC_QUESTION = "What is this about? Answer in one sentence.";
const questionFor = (info) => EXAMPLE_QUESTIONS[info.name] || GENERIC_QUESTION;

async function selectSchema(info) {
  const question = $("free-text");
  if (!question.value || (current && question.value === questionFor(current))) question.value = questionFor(info);
  current = info;
  $("layout-name").textContent = `${info.name} (${info.num_tokens} positions)`;
  $("layout").textContent = "";  // never the previous schema's blocks under this name
  clearFidelity();
  drawPicks(info);
  compose();
  await drawLayout(info);
}

// The prompt as a chat turn: the ticked modules (a nested one inside its parents, each inside an element
// of its schema section's role), the free text as the user's question (in the turn that holds the user
// section's modules, or a turn of its own), then the assistant's open turn, which the model answers.
function compose() {
  if (!current) return;
  const argument = (path) => [...document.querySelectorAll("#module-picks .param-value")]
    .filter((input) => input.dataset.module === path && input.value)
    .map((input) => " " + input.dataset.param + '="' + escapeXml(input.value).replace(/"/g, "&quot;") + '"').join("");
  const picked = [...document.querySelectorAll("#module-picks input[type=checkbox]:checked")].map((b) => b.value);
  const byPath = Object.fromEntries(current.modules.map((m) => [m.path, m]));
  const roleOf = (path) => lineage(byPath, path)[0].role || null;
  const groups = [];  // [role, paths] in schema order, consecutive modules of one role together
  for (const path of picked) {
    const role = roleOf(path), last = groups[groups.length - 1];
    if (last && last[0] === role) last[1].push(path); else groups.push([role, [path]]);
  }
  const question = escapeXml($("free-text").value);
  let body = groups.map(([role, paths]) => role ? `<${role}>${importXml(current, paths, argument)}</${role}>`
    : importXml(current, paths, argument)).join("");
  if (groups.length && groups[groups.length - 1][0] === "user") body = body.slice(0, -"</user>".length) + question + "</user>";
  else if (question.trim()) body += `<user>${question}</user>`;
  $("pml-prompt").value = `<prompt schema="${current.name}">${body}<assistant/></prompt>`;
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
    const e = await api("/v1/prompts/explain", { method: "POST",
      body: JSON.stringify({ prompt: $("pml-prompt").value, fidelity: $("fidelity").value || null }) });
    $("explanation").textContent = `${e.prompt_tokens} prompt tokens: ${e.cached_tokens} cached, ${e.tokens_to_compute} to compute; ` +
      `${e.exact ? "exact" : "approximate (" + e.approximations.join("; ") + ")"}, fidelity ${e.fidelity}, ` +
      `${e.positions} positions`;
  } catch (exc) { $("explanation").textContent = exc.message; }
});

const ORIGIN_LABELS = { prefix: "prefix block", recomputed: "recomputed", computed: "computed now" };

// What a span's colour says: a module's KV from its tier, a prefix block, recomputed, computed now.
function spanKind(span) {
  if (span.origin === "module") {
    return { cls: "tier-" + (span.tier || "none"), label: span.tier === "computed" ? "module encoded now" : "module from " + span.tier };
  }
  return { cls: "tier-" + span.origin, label: ORIGIN_LABELS[span.origin] + (span.tier ? " (" + span.tier + ")" : "") };
}

// The prompt as its text, one coloured <span> per span of the server's report, and a legend that
// counts tokens per origin.
function drawSpans(spans) {
  const box = $("spans"), legend = $("span-legend");
  box.textContent = ""; legend.textContent = "";
  const counts = new Map();
  for (const span of spans) {
    const kind = spanKind(span), element = document.createElement("span");
    element.className = "origin-" + span.origin + " " + kind.cls;
    element.dataset.origin = span.origin;
    if (span.module) element.dataset.module = span.module;
    if (span.tier) element.dataset.tier = span.tier;
    element.textContent = span.text;
    element.title = `${kind.label}${span.module ? ", module " + span.module : ""}: ${span.num_tokens} tokens, ` +
      `positions ${span.start}-${span.start + span.num_tokens - 1}`;
    box.append(element);
    const entry = counts.get(kind.label) || { cls: kind.cls, tokens: 0 };
    entry.tokens += span.num_tokens;
    counts.set(kind.label, entry);
  }
  for (const [label, entry] of counts) {
    const item = document.createElement("span");
    item.className = entry.cls;
    item.textContent = `${label}: ${entry.tokens}`;
    legend.append(item);
  }
}

// What to tell the user when a run generated no text: an instruct model given no open turn ends at once.
function emptyOutputHint(finish, numTokens, prompt) {
  const turn = /<assistant\s*\/>\s*<\/prompt>\s*$/.test(prompt) ? "" :
    " The prompt does not end with an open assistant turn: put the question inside <user>…</user> and end it " +
    "with <assistant/>, the turn an instruct model answers.";
  return `The model generated no text (${numTokens} tokens, finish reason: ${finish || "none"}).${turn}` +
    (turn ? "" : " It ended its turn at once: ask something the ticked modules answer.");
}

$("run").addEventListener("click", async () => {
  $("output").textContent = ""; $("stats").textContent = ""; $("spans").textContent = ""; $("span-legend").textContent = "";
  $("output-hint").hidden = true;
  const started = performance.now(), prompt = $("pml-prompt").value;
  let first = null, finish = null;
  try {
    await stream("/v1/generate", { prompt, stream: true, max_tokens: 32, temperature: 0,
      fidelity: $("fidelity").value || null, return_spans: true }, (chunk) => {
      for (const choice of chunk.choices || []) {
        if (choice.text) { if (first === null) first = performance.now() - started; $("output").textContent += choice.text; }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      if (chunk.usage) {
        if (!$("output").textContent.trim()) {
          $("output-hint").hidden = false;
          $("output-hint").textContent = emptyOutputHint(finish, chunk.usage.completion_tokens, prompt);
        }
        drawSpans(chunk.cache.spans || []);
        const seconds = (performance.now() - started) / 1000;
        $("stats").textContent = `TTFT ${first === null ? "-" : first.toFixed(0)} ms (server ${chunk.timings.ttft_ms.toFixed(1)} ms), ` +
          `${(chunk.usage.completion_tokens / seconds).toFixed(1)} tokens/s, ${chunk.usage.cached_tokens} of ${chunk.usage.prompt_tokens} ` +
          `prompt tokens cached, fidelity ${chunk.cache.fidelity} (${chunk.cache.positions} positions)` +
          (chunk.cache.recomputed_tokens ? ` (${chunk.cache.recomputed_tokens} tokens recomputed)` : "") +
          `, ${chunk.cache.exact ? "exact" : "approximate: " + chunk.cache.approximations.join("; ")}`;
        if (current) drawLayout(current);  // tiers may have changed
      }
    });
  } catch (exc) { $("output").textContent = exc.message; }
});

// -- fidelity report ----------------------------------------------------------------------------
function clearFidelity() {
  $("fidelity-table").hidden = true; $("fidelity-table").textContent = "";
  $("fidelity-details").hidden = true; $("fidelity-samples-list").textContent = "";
  $("fidelity-status").textContent = "";
}

function tableRow(cells, tag = "td") {
  const row = document.createElement("tr");
  for (const text of cells) {
    const cell = document.createElement(tag);
    cell.textContent = text;
    row.append(cell);
  }
  return row;
}

// Per mode: greedy first-token agreement with a full prefill (95 % interval) and first-token KL; then
// what was sampled and how, and each combination's result per mode.
function drawFidelity(report) {
  const table = $("fidelity-table"), percent = (x) => (100 * x).toFixed(0) + "%";
  table.textContent = "";
  table.append(tableRow(["mode", "top-1 agreement", "95% interval", "mean KL", "max KL", "samples"], "th"));
  for (const [mode, stats] of Object.entries(report.modes)) {
    const row = tableRow([mode, percent(stats.top1_agreement),
      `${percent(stats.agreement_ci95[0])}-${percent(stats.agreement_ci95[1])}`, stats.mean_kl.toFixed(4),
      stats.max_kl.toFixed(4), String(stats.num_samples)]);
    row.dataset.mode = mode;
    table.append(row);
  }
  table.hidden = false;
  $("fidelity-status").textContent = `${report.num_samples} combinations (seed ${report.seed}), question ` +
    `${JSON.stringify(report.question)}; balanced k=${report.fidelity_head_tokens}, ${report.fidelity_positions} ` +
    `positions, ${report.fidelity_context} context; ` +
    (report.cached ? "from the report cache" : `computed in ${(report.elapsed_ms / 1000).toFixed(1)} s`) +
    ". KL: over both top-20 lists and the rest, a lower bound.";
  const list = $("fidelity-samples-list");
  list.textContent = "";
  for (const sample of report.samples) {
    const item = document.createElement("li");
    const marks = Object.entries(sample.modes).map(([mode, r]) => `${mode} ${r.top1_agrees ? "=" : "≠"}`).join(", ");
    item.textContent = `${sample.module_paths.join(" + ") || "(no modules)"}: ${marks}`;
    item.title = sample.prompt;
    list.append(item);
  }
  $("fidelity-details").hidden = false;
}

$("fidelity-run").addEventListener("click", async () => {
  if (!current) return;
  const info = current;
  clearFidelity();
  $("fidelity-status").textContent = "computing: a full prefill and one request per mode for each sample…";
  const query = new URLSearchParams({ num_samples: $("fidelity-samples").value || "8", question: $("free-text").value });
  try {
    const report = await api(`/v1/schemas/${encodeURIComponent(info.name)}/fidelity?${query}`);
    if (current === info) drawFidelity(report);  // another schema selected meanwhile: not its report
  } catch (exc) { if (current === info) $("fidelity-status").textContent = exc.message; }
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

reloadSchemas();
pollMetrics();
setInterval(pollMetrics, 3000);
