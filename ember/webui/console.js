// The Ember console's script, shared by the gateway's page and `ember serve`'s. No libraries and
// no network beyond this origin. Keys live in sessionStorage (gone with the tab) and travel only as
// Authorization headers, never cookies, so another site cannot act with them.
"use strict";

const $ = (selector) => document.querySelector(selector);

function element(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value);
  }
  for (const child of children) node.append(child instanceof Node ? child : String(child ?? ""));
  return node;
}

async function api(path, key, options = {}) {
  const headers = { ...(options.headers || {}), authorization: "Bearer " + key };
  if (options.body) headers["content-type"] = "application/json";
  const response = await fetch(path, { ...options, headers });
  const body = response.headers.get("content-type")?.includes("json") ? await response.json() : await response.text();
  if (!response.ok) throw new Error(body?.error?.message || `HTTP ${response.status}`);
  return body;
}

function showError(target, error) {
  $(target).textContent = error ? String(error.message || error) : "";
}

// --- charts: one SVG polyline per series --------------------------------------------------------

const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2"];

function lineChart(container, title, points, series, unit) {
  const width = 460, height = 150, left = 48, bottom = 18, top = 8;
  const svgNS = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(svgNS, "svg");
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("class", "chart");
  const values = series.flatMap((s) => points.map(s.value)).filter((v) => v !== null && v !== undefined);
  const max = Math.max(...values, 0) || 1;
  // The x axis ends now and spans at least the last 5 minutes, so a fresh gateway's few buckets
  // read as recent rather than filling the chart.
  const t1 = Date.now() / 1000;
  const t0 = Math.min(points.length ? points[0].t : t1, t1 - 300);
  const x = (t) => left + ((t - t0) / Math.max(t1 - t0, 1)) * (width - left - 4);
  const y = (v) => top + (1 - v / max) * (height - top - bottom);
  const add = (tag, attributes, text) => {
    const node = document.createElementNS(svgNS, tag);
    for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
    if (text !== undefined) node.textContent = text;
    svg.append(node);
    return node;
  };
  add("line", { x1: left, x2: width, y1: y(0), y2: y(0), stroke: "#999" });
  add("text", { x: 2, y: top + 8, "font-size": 10 }, formatNumber(max));
  add("text", { x: 2, y: y(0), "font-size": 10 }, "0");
  add("text", { x: left, y: height - 4, "font-size": 10 }, new Date(t0 * 1000).toLocaleTimeString());
  add("text", { x: width - 4, y: height - 4, "font-size": 10, "text-anchor": "end" }, points.length ? "now" : "no data yet");
  series.forEach((s, index) => {
    const color = COLORS[index % COLORS.length];
    const coordinates = points
      .filter((p) => s.value(p) !== null && s.value(p) !== undefined)
      .map((p) => [x(p.t).toFixed(1), y(s.value(p)).toFixed(1)]);
    if (!coordinates.length) return;
    // A line through the buckets, and a dot on each: a lone bucket has no line to draw.
    const group = add("g", { "data-series": s.name, fill: color, stroke: color });
    const line = document.createElementNS(svgNS, "polyline");
    line.setAttribute("points", coordinates.map((c) => c.join(",")).join(" "));
    line.setAttribute("fill", "none");
    line.setAttribute("stroke-width", 1.5);
    group.append(line);
    for (const [cx, cy] of coordinates) {
      const dot = document.createElementNS(svgNS, "circle");
      Object.entries({ cx, cy, r: 2 }).forEach(([name, value]) => dot.setAttribute(name, value));
      group.append(dot);
    }
  });
  const legend = element("div", { class: "legend" });
  series.forEach((s, index) => {
    const entry = element("span", {}, "■ " + s.name + " ");
    entry.style.color = COLORS[index % COLORS.length]; // through the CSSOM: the CSP forbids style attributes
    legend.append(entry);
  });
  container.append(element("figure", { "data-chart": title }, element("figcaption", {}, `${title} (${unit})`), svg, legend));
}

function formatNumber(value) {
  if (value === null || value === undefined) return "–";
  if (value >= 100) return value.toFixed(0);
  if (value >= 1) return value.toFixed(2);
  return value.toPrecision(2);
}

function renderCharts(container, data) {
  const points = data.points;
  container.replaceChildren();
  const statuses = [...new Set(points.flatMap((p) => Object.keys(p.requests_per_s)))].sort();
  const quantiles = (field) => ["p50", "p90", "p99"].map((q) => ({ name: q, value: (p) => p[field][q] }));
  lineChart(container, "Requests", points, statuses.map((status) => ({ name: status, value: (p) => p.requests_per_s[status] || 0 })), "per s, by status");
  lineChart(container, "Time to first token", points, quantiles("ttft_s"), "s");
  lineChart(container, "Inter-token latency", points, quantiles("itl_s"), "s");
  lineChart(container, "Output tokens", points, [{ name: "tokens/s", value: (p) => p.output_tokens_per_s }], "per s");
  lineChart(container, "Queue", points, [{ name: "depth", value: (p) => p.queue_depth }], "requests");
  lineChart(container, "Queue wait", points, quantiles("queue_wait_s"), "s");
  lineChart(container, "Cost", points, [{ name: "per 1M output tokens", value: (p) => p.cost_per_1m_output_tokens }], "price unit");
}

// --- playground: a streamed chat over SSE, with the caller's API key -----------------------------

const conversation = [];

async function loadModels(modelSelect, key) {
  const models = await api("/v1/models", key);
  modelSelect.replaceChildren(...models.data.map((m) => element("option", { value: m.id }, m.id)));
}

// The tools textarea's array, or undefined when empty; an Error naming the problem otherwise.
function parseTools(text) {
  if (!text.trim()) return undefined;
  let tools;
  try {
    tools = JSON.parse(text);
  } catch (error) {
    throw new Error("Tools: not valid JSON (" + error.message + ")");
  }
  if (!Array.isArray(tools)) throw new Error("Tools: must be a JSON array of tools");
  return tools;
}

// Streamed tool calls arrive in pieces (OpenAI's delta.tool_calls): the first names the call, the
// rest append to its arguments.
function addToolCallDeltas(calls, deltas) {
  for (const delta of deltas) {
    const call = (calls[delta.index] ??= { id: delta.id, type: "function", function: { name: "", arguments: "" } });
    if (delta.id) call.id = delta.id;
    if (delta.function?.name) call.function.name += delta.function.name;
    if (delta.function?.arguments) call.function.arguments += delta.function.arguments;
  }
}

function showToolCalls(box, calls) {
  box.replaceChildren(...calls.map((call) =>
    element("pre", { "data-tool-call": call.function.name }, `${call.function.name}(${call.function.arguments})`)));
}

// A reply that called tools asks the user for each tool's result; sending them continues the
// conversation as OpenAI's `role: "tool"` messages, answering the assistant's tool_calls message.
function askForToolResults(form, key, calls) {
  const fields = calls.map((call) =>
    element("label", {}, `Result of ${call.function.name} (${call.id})`,
      element("textarea", { rows: 2, spellcheck: "false", "data-tool-result": call.id })));
  const box = element("div", { class: "message tool-results" }, ...fields,
    element("button", { type: "button", id: "tool-results-send" }, "Send tool results"));
  box.querySelector("button").addEventListener("click", async () => {
    showError("#playground-error");
    let tools;
    try { tools = parseTools(form.tools.value); } catch (error) { showError("#playground-error", error); return; }
    const results = calls.map((call) => ({
      role: "tool", tool_call_id: call.id, content: box.querySelector(`textarea[data-tool-result="${call.id}"]`).value,
    }));
    const missing = calls.find((call, index) => !results[index].content.trim());
    if (missing) {
      showError("#playground-error", `Tool results: enter the result of ${missing.function.name} (${missing.id})`);
      return;
    }
    const bubbles = results.map((result, index) =>
      element("div", { class: "message tool", "data-tool-call-id": result.tool_call_id }, `${calls[index].function.name} → ${result.content}`));
    box.replaceWith(...bubbles);
    if (!(await converse(form, key, tools, results))) { // refused: the results can be sent again
      bubbles[0].before(box);
      bubbles.forEach((bubble) => bubble.remove());
    }
  });
  $("#chat-log").append(box);
}

async function sendChat(form, key) {
  const prompt = form.prompt.value.trim();
  if (!prompt) return;
  const tools = parseTools(form.tools.value); // a mistake stops here, before anything is shown or sent
  $("#chat-log").append(element("div", { class: "message user" }, prompt));
  form.prompt.value = "";
  await converse(form, key, tools, [{ role: "user", content: prompt }]);
}

// Adds `messages` to the conversation and streams the model's reply to them; true once answered. A
// refused request takes them back out, so the next try does not send them twice.
async function converse(form, key, tools, messages) {
  const log = $("#chat-log");
  conversation.push(...messages);
  // The reply's text and its tool calls share the assistant's bubble: a reply that only calls tools
  // shows its calls there rather than an empty bubble.
  const text = document.createTextNode(""); // the bubble's own text: the reply, as selectors see it
  const callsBox = element("div", { class: "tool-calls" });
  const reply = element("div", { class: "message assistant", "data-streaming": "true" }, text);
  log.append(reply);
  const system = form.system.value ? [{ role: "system", content: form.system.value }] : [];
  const body = {
    model: form.model.value, messages: [...system, ...conversation], stream: true, stream_options: { include_usage: true },
    temperature: Number(form.temperature.value), top_p: Number(form.top_p.value), max_tokens: Number(form.max_tokens.value),
  };
  if (form.json_mode.checked) body.response_format = { type: "json_object" };
  if (tools) Object.assign(body, { tools, tool_choice: form.tool_choice.value });
  const started = performance.now();
  let firstTokenAt = null, tokens = 0;
  const calls = [];
  const refused = (message) => {
    text.data = "Error: " + message;
    reply.dataset.streaming = "false";
    conversation.splice(conversation.length - messages.length);
    return false;
  };
  let response;
  try {
    response = await fetch("/v1/chat/completions", {
      method: "POST", headers: { authorization: "Bearer " + key, "content-type": "application/json" }, body: JSON.stringify(body),
    });
  } catch (error) {
    return refused(error.message);
  }
  if (!response.ok) {
    const error = await response.json().catch(() => ({}));
    return refused(error?.error?.message || `HTTP ${response.status}`);
  }
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((line) => line.startsWith("data: ")).map((line) => line.slice(6)).join("\n");
      if (!data || data === "[DONE]") continue;
      const chunk = JSON.parse(data);
      if (chunk.error) { text.data += "\n[error: " + chunk.error.message + "]"; continue; }
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
      const delta = chunk.choices?.[0]?.delta;
      if (delta?.content || delta?.tool_calls) firstTokenAt ??= performance.now();
      if (delta?.content) text.data += delta.content;
      if (delta?.tool_calls) {
        addToolCallDeltas(calls, delta.tool_calls);
        if (!callsBox.isConnected) reply.append(callsBox);
        showToolCalls(callsBox, calls);
      }
    }
  }
  reply.dataset.streaming = "false";
  const content = text.data;
  conversation.push(calls.length ? { role: "assistant", content: content || null, tool_calls: calls } : { role: "assistant", content });
  if (calls.length) askForToolResults(form, key, calls);
  const seconds = (performance.now() - (firstTokenAt ?? started)) / 1000;
  const ttft = firstTokenAt === null ? "–" : ((firstTokenAt - started) / 1000).toFixed(3) + " s";
  $("#chat-stats").textContent = `TTFT ${ttft} · ${tokens} tokens · ${tokens > 1 && seconds > 0 ? ((tokens - 1) / seconds).toFixed(1) : "–"} tokens/s`;
  return true;
}

function setUpPlayground() {
  const form = $("#playground");
  const keyInput = $("#user-key");
  keyInput.value = sessionStorage.getItem("ember.userKey") || "";
  const connect = async () => {
    sessionStorage.setItem("ember.userKey", keyInput.value);
    showError("#playground-error");
    try { await loadModels(form.model, keyInput.value); } catch (error) { showError("#playground-error", error); }
  };
  $("#user-key-form").addEventListener("submit", (event) => { event.preventDefault(); connect(); });
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    showError("#playground-error");
    try { await sendChat(form, keyInput.value); } catch (error) { showError("#playground-error", error); }
  });
  $("#chat-clear").addEventListener("click", () => { conversation.length = 0; $("#chat-log").replaceChildren(); });
  if (keyInput.value) connect();
}
