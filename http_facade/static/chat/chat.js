// The chat page: one conversation with a served model over POST /v1/chat/completions (SSE).
// No framework and no build step. The API key (if the server needs one) is kept in this
// browser's localStorage and sent as "Authorization: Bearer <key>".
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "sluice.apiKey";
const state = { history: [], controller: null };

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

function setStatus(text) {
  $("status").textContent = text;
}

async function errorText(resp) {
  try {
    const body = await resp.json();
    return body.error ? body.error.message : JSON.stringify(body);
  } catch (e) {
    return `HTTP ${resp.status}`;
  }
}

async function loadModels() {
  const select = $("model");
  const previous = select.value;
  try {
    const resp = await fetch("/v1/models", { headers: headers() });
    if (!resp.ok) {
      setStatus(`Could not list the models: ${await errorText(resp)}`);
      return;
    }
    const body = await resp.json();
    select.replaceChildren(...body.data.map((m) => new Option(m.id, m.id)));
    if (body.data.some((m) => m.id === previous)) select.value = previous;
    setStatus(body.data.length ? "" : "The server lists no model.");
  } catch (e) {
    setStatus(`Could not list the models: ${e.message}`);
  }
}

// ---- markdown: the text is escaped first, then a small subset is formatted (code blocks,
// inline code, headings, bold, italics, lists, links to http(s) addresses). Nothing the model
// writes can add markup of its own.
function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

function inline(text) {
  return text
    .replace(/`([^`\n]+)`/g, "<code>$1</code>")
    .replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^*])\*([^*\n]+)\*/g, "$1<em>$2</em>")
    .replace(/\[([^\]\n]+)\]\((https?:\/\/[^)\s]+)\)/g, '<a href="$2" rel="noopener noreferrer" target="_blank">$1</a>');
}

function renderMarkdown(source) {
  const parts = escapeHtml(source).split(/^```[^\n]*\n?/m);
  let html = "";
  parts.forEach((part, i) => {
    if (i % 2 === 1) {                 // inside a fence (an unclosed one runs to the end)
      html += `<pre><code>${part}</code></pre>`;
      return;
    }
    let list = null;
    for (const line of part.split("\n")) {
      const item = line.match(/^\s*(?:[-*]|\d+\.)\s+(.*)$/);
      if (item) {
        if (!list) { html += "<ul>"; list = true; }
        html += `<li>${inline(item[1])}</li>`;
        continue;
      }
      if (list) { html += "</ul>"; list = null; }
      const heading = line.match(/^(#{1,6})\s+(.*)$/);
      if (heading) html += `<h${heading[1].length}>${inline(heading[2])}</h${heading[1].length}>`;
      else if (line.trim()) html += `<p>${inline(line)}</p>`;
    }
    if (list) html += "</ul>";
  });
  return html;
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  div.innerHTML = `<div class="role">${role}</div><div class="body"></div><div class="stats"></div>`;
  div.querySelector(".body").innerHTML = renderMarkdown(text);
  $("messages").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function requestBody(messages) {
  const body = {
    model: $("model").value,
    messages,
    stream: true,
    stream_options: { include_usage: true },
  };
  const numbers = { temperature: "temperature", top_p: "top-p", max_tokens: "max-tokens" };
  for (const [name, id] of Object.entries(numbers)) {
    const v = $(id).value.trim();
    if (v !== "") body[name] = Number(v);
  }
  const extra = $("extra").value.trim();
  if (extra) Object.assign(body, JSON.parse(extra));   // a syntax error is shown to the user
  return body;
}

// Reads "data: ..." events from the response body; calls onEvent with each parsed one.
async function readEvents(resp, onEvent) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}

function stats(t) {
  const parts = [];
  if (t.first !== null) parts.push(`TTFT ${((t.first - t.start) / 1000).toFixed(2)} s`);
  if (t.tokens > 1 && t.last > t.first) {
    parts.push(`${((t.tokens - 1) / ((t.last - t.first) / 1000)).toFixed(1)} tokens/s`);
  }
  parts.push(`${t.tokens} tokens`);
  if (t.finish) parts.push(t.finish);
  return parts.join(" · ");
}

async function send(text) {
  const system = $("system").value.trim();
  state.history.push({ role: "user", content: text });
  addMessage("user", text);
  const messages = (system ? [{ role: "system", content: system }] : []).concat(state.history);
  const reply = addMessage("assistant", "");
  const out = reply.querySelector(".body");
  const info = reply.querySelector(".stats");
  const timing = { start: performance.now(), first: null, last: null, tokens: 0, finish: null };
  let answer = "";
  state.controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  setStatus("Generating…");
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody(messages)),
      signal: state.controller.signal,
    });
    if (!resp.ok) throw new Error(await errorText(resp));
    await readEvents(resp, (event) => {
      if (event.error) throw new Error(event.error.message);
      if (event.usage) timing.tokens = event.usage.completion_tokens;
      const choice = event.choices && event.choices[0];
      if (!choice) return;
      const piece = choice.delta && choice.delta.content;
      if (piece) {
        const now = performance.now();
        if (timing.first === null) timing.first = now;
        timing.last = now;
        timing.tokens += 1;
        answer += piece;
        out.innerHTML = renderMarkdown(answer);
        info.textContent = stats(timing);
        reply.scrollIntoView({ block: "end" });
      }
      if (choice.finish_reason) timing.finish = `finished: ${choice.finish_reason}`;
    });
    setStatus("");
  } catch (e) {
    if (e.name === "AbortError") {
      timing.finish = "stopped";
      setStatus("Stopped.");
    } else {
      reply.classList.add("error");
      out.textContent = e.message;
      setStatus("The request failed.");
    }
  } finally {
    info.textContent = stats(timing);
    reply.dataset.done = timing.finish || "error";
    if (answer) state.history.push({ role: "assistant", content: answer });
    state.controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

function init() {
  $("api-key").value = localStorage.getItem(KEY_STORE) || "";
  $("api-key").addEventListener("change", () => {
    localStorage.setItem(KEY_STORE, $("api-key").value.trim());
    loadModels();
  });
  $("reload-models").addEventListener("click", loadModels);
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || state.controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("clear").addEventListener("click", () => {
    state.history = [];
    $("messages").replaceChildren();
  });
  loadModels();
}

init();
