// The chat page of `pagellm serve`: a client of the server's own OpenAI API (/v1/models and streamed
// /v1/chat/completions), with conversations and settings kept in this browser's localStorage.
// Plain JavaScript, no build step, no third-party code; everything the model or the user wrote is put on the
// page as text (textContent), never as HTML.
"use strict";

const STORE = "pagellm.chat.conversations";
const CURRENT = "pagellm.chat.current";
const SETTINGS = "pagellm.chat.settings";
const KEY = "pagellm.chat.apiKey"; // sessionStorage: the key lives as long as the tab, not on disk

const $ = (id) => document.getElementById(id);
const state = {
  conversations: [],
  currentId: null,
  controller: null, // the AbortController of the stream in flight, if any
  attachment: null, // a data: URL
  keyWaiters: [],
};

// -- storage ------------------------------------------------------------------------------------------------

function load(key, fallback) {
  try {
    const value = JSON.parse(localStorage.getItem(key));
    return value === null ? fallback : value;
  } catch (e) {
    return fallback;
  }
}

function saveConversations() {
  const body = JSON.stringify(state.conversations);
  try {
    localStorage.setItem(STORE, body);
  } catch (e) {
    // over the storage quota (images are large): keep the text, drop the stored images
    const slim = state.conversations.map((c) => ({
      ...c,
      messages: c.messages.map((m) => (m.image ? { ...m, image: null, imageDropped: true } : m)),
    }));
    try {
      localStorage.setItem(STORE, JSON.stringify(slim));
      setStatus("Browser storage is full: images are not kept after reload.");
    } catch (e2) {
      setStatus("Browser storage is full: this conversation is not saved.");
    }
  }
  localStorage.setItem(CURRENT, state.currentId || "");
}

function saveSettings() {
  const settings = {
    model: $("model").value,
    system: $("system").value,
    temperature: $("temperature").value,
    top_p: $("top-p").value,
    max_tokens: $("max-tokens").value,
  };
  localStorage.setItem(SETTINGS, JSON.stringify(settings));
  sessionStorage.setItem(KEY, $("api-key").value.trim());
}

function restoreSettings() {
  const s = load(SETTINGS, {});
  if (s.system !== undefined) $("system").value = s.system;
  if (s.temperature !== undefined) $("temperature").value = s.temperature;
  if (s.top_p !== undefined) $("top-p").value = s.top_p;
  if (s.max_tokens !== undefined) $("max-tokens").value = s.max_tokens;
  $("api-key").value = sessionStorage.getItem(KEY) || "";
  return s;
}

// -- conversations ------------------------------------------------------------------------------------------

function current() {
  return state.conversations.find((c) => c.id === state.currentId) || null;
}

function newConversation() {
  const conversation = { id: Date.now().toString(36) + Math.random().toString(36).slice(2, 6), title: "New chat", messages: [] };
  state.conversations.unshift(conversation);
  state.currentId = conversation.id;
  saveConversations();
  render();
  $("prompt").focus();
  return conversation;
}

function deleteConversation(id) {
  if (state.controller && state.currentId === id) state.controller.abort();
  state.conversations = state.conversations.filter((c) => c.id !== id);
  if (state.currentId === id) state.currentId = state.conversations.length ? state.conversations[0].id : null;
  saveConversations();
  render();
}

function switchConversation(id) {
  if (state.controller) state.controller.abort();
  state.currentId = id;
  saveConversations();
  render();
}

function renderConversationList() {
  const list = $("conversations");
  list.replaceChildren();
  for (const c of state.conversations) {
    const item = document.createElement("li");
    item.className = c.id === state.currentId ? "active" : "";
    item.dataset.id = c.id;
    const open = document.createElement("button");
    open.type = "button";
    open.className = "open";
    open.textContent = c.title;
    open.title = c.title;
    open.addEventListener("click", () => switchConversation(c.id));
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "delete";
    remove.textContent = "\u00d7";
    remove.title = "Delete this conversation";
    remove.setAttribute("aria-label", "Delete " + c.title);
    remove.addEventListener("click", () => deleteConversation(c.id));
    item.append(open, remove);
    list.append(item);
  }
}

// -- rendering messages -------------------------------------------------------------------------------------

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function renderMessage(message) {
  const node = element("article", "message " + message.role);
  node.dataset.state = message.state || "done";
  node.append(element("div", "role", message.role === "user" ? "You" : message.model || "Assistant"));
  if (message.image) {
    const img = element("img", "image");
    img.src = message.image;
    img.alt = "attached image";
    node.append(img);
  } else if (message.imageDropped) {
    node.append(element("div", "note", "(image not kept: browser storage was full)"));
  }
  if (message.reasoning) {
    const details = element("details", "reasoning");
    details.open = message.state === "streaming";
    details.append(element("summary", "", message.state === "streaming" ? "Thinking\u2026" : "Reasoning"));
    details.append(element("div", "reasoning-text", message.reasoning));
    node.append(details);
  }
  for (const call of message.tool_calls || []) {
    const box = element("div", "tool-call");
    box.append(element("div", "tool-name", "Tool call: " + (call.function.name || "?")));
    box.append(element("pre", "tool-args", call.function.arguments || ""));
    node.append(box);
  }
  node.append(element("div", "content", message.content || ""));
  if (message.state === "stopped") node.append(element("div", "note", "Stopped."));
  if (message.error) node.append(element("div", "error", message.error));
  if (message.finish === "length") node.append(element("div", "note", "Cut off at max tokens."));
  return node;
}

function render() {
  renderConversationList();
  const conversation = current();
  $("chat-title").textContent = conversation ? conversation.title : "New chat";
  const box = $("messages");
  box.replaceChildren();
  const messages = conversation ? conversation.messages : [];
  if (!messages.length) box.append($("empty-template").content.cloneNode(true));
  for (const m of messages) box.append(renderMessage(m));
  box.scrollTop = box.scrollHeight;
  updateButtons();
}

function rerenderLast(conversation) {
  if (conversation.id !== state.currentId) return;
  const box = $("messages");
  const stick = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
  const last = box.lastElementChild;
  const fresh = renderMessage(conversation.messages[conversation.messages.length - 1]);
  if (last && last.classList.contains("message")) last.replaceWith(fresh);
  else box.append(fresh);
  if (stick) box.scrollTop = box.scrollHeight;
}

function updateButtons() {
  const busy = state.controller !== null;
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  const conversation = current();
  $("regenerate").disabled = busy || !conversation || !conversation.messages.some((m) => m.role === "user");
}

function setStatus(text) {
  $("status").textContent = text || "";
}

// -- the API ------------------------------------------------------------------------------------------------

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

// Resolves once the user gave a key in the dialog (true) or cancelled it (false).
function askForKey() {
  return new Promise((resolve) => {
    state.keyWaiters.push(resolve);
    const dialog = $("key-dialog");
    if (!dialog.open) {
      $("key-input").value = $("api-key").value;
      dialog.showModal();
      $("key-input").focus();
    }
  });
}

function keyGiven(given) {
  const dialog = $("key-dialog");
  if (dialog.open) dialog.close();
  if (given) {
    $("api-key").value = $("key-input").value.trim();
    saveSettings();
  }
  const waiters = state.keyWaiters;
  state.keyWaiters = [];
  for (const resolve of waiters) resolve(given);
}

// fetch that asks for the API key on 401 and tries again with it
async function api(path, options) {
  for (;;) {
    const response = await fetch(path, { ...options, headers: headers() });
    if (response.status !== 401) return response;
    if (!(await askForKey())) return response;
  }
}

async function errorText(response) {
  try {
    const body = await response.json();
    if (body.error) return typeof body.error === "string" ? body.error : body.error.message;
    return JSON.stringify(body);
  } catch (e) {
    return response.status + " " + response.statusText;
  }
}

async function loadModels() {
  const select = $("model");
  const wanted = load(SETTINGS, {}).model;
  try {
    const response = await api("/v1/models", { method: "GET" });
    if (!response.ok) throw new Error(await errorText(response));
    const models = (await response.json()).data || [];
    select.replaceChildren();
    for (const m of models) {
      const option = element("option", "", m.id);
      option.value = m.id;
      select.append(option);
    }
    if (models.some((m) => m.id === wanted)) select.value = wanted;
    setStatus("");
  } catch (e) {
    setStatus("Could not list the models: " + e.message);
  }
}

function toApiMessages(conversation) {
  const out = [];
  const system = $("system").value.trim();
  if (system) out.push({ role: "system", content: system });
  for (const m of conversation.messages) {
    if (m.role === "assistant") {
      if (m.content) out.push({ role: "assistant", content: m.content });
    } else if (m.image) {
      const parts = [];
      if (m.content) parts.push({ type: "text", text: m.content });
      parts.push({ type: "image_url", image_url: { url: m.image } });
      out.push({ role: "user", content: parts });
    } else {
      out.push({ role: "user", content: m.content });
    }
  }
  return out;
}

function requestBody(conversation) {
  const body = { model: $("model").value || undefined, messages: toApiMessages(conversation), stream: true };
  body.stream_options = { include_usage: true };
  const number = (id) => {
    const value = $(id).value.trim();
    return value === "" ? undefined : Number(value);
  };
  body.temperature = number("temperature");
  body.top_p = number("top-p");
  body.max_tokens = number("max-tokens");
  return body;
}

// Reads a server-sent-event stream, calling onData with each event's data (a string) until [DONE].
async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    const events = buffer.split(/\r?\n\r?\n/);
    buffer = events.pop();
    for (const event of events) {
      const data = event
        .split(/\r?\n/)
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      onData(data);
    }
  }
}

function applyChunk(message, chunk) {
  if (chunk.error) {
    message.error = chunk.error.message || String(chunk.error);
    return;
  }
  if (chunk.usage) message.usage = chunk.usage;
  for (const choice of chunk.choices || []) {
    const delta = choice.delta || {};
    if (delta.content) message.content += delta.content;
    const thought = delta.reasoning_content || delta.reasoning;
    if (thought) message.reasoning = (message.reasoning || "") + thought;
    for (const call of delta.tool_calls || []) {
      message.tool_calls = message.tool_calls || [];
      const index = call.index === undefined ? message.tool_calls.length : call.index;
      const entry = (message.tool_calls[index] = message.tool_calls[index] || { id: "", function: { name: "", arguments: "" } });
      if (call.id) entry.id = call.id;
      if (call.function && call.function.name) entry.function.name += call.function.name;
      if (call.function && call.function.arguments) entry.function.arguments += call.function.arguments;
    }
    if (choice.finish_reason) message.finish = choice.finish_reason;
  }
}

// Streams the assistant's answer to the conversation as it stands.
async function complete(conversation) {
  const message = { role: "assistant", content: "", state: "streaming", model: $("model").value };
  const body = requestBody(conversation); // before the empty answer joins the conversation
  conversation.messages.push(message);
  state.controller = new AbortController();
  render();
  setStatus("Generating\u2026");
  let frame = 0;
  const refresh = () => {
    if (!frame) frame = requestAnimationFrame(() => ((frame = 0), rerenderLast(conversation)));
  };
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST",
      body: JSON.stringify(body),
      signal: state.controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    await readEvents(response, (data) => {
      applyChunk(message, JSON.parse(data));
      refresh();
    });
    message.state = message.error ? "error" : "done";
    const usage = message.usage;
    setStatus(usage ? usage.completion_tokens + " tokens" : "");
  } catch (e) {
    if (e.name === "AbortError") {
      message.state = "stopped";
      setStatus("Stopped.");
    } else {
      message.state = "error";
      message.error = message.error || e.message;
      setStatus("");
    }
  } finally {
    if (frame) cancelAnimationFrame(frame);
    state.controller = null;
    saveConversations();
    render();
  }
}

// -- user actions -------------------------------------------------------------------------------------------

function send(event) {
  event.preventDefault();
  if (state.controller) return;
  const text = $("prompt").value.trim();
  if (!text && !state.attachment) return;
  const conversation = current() || newConversation();
  const message = { role: "user", content: text };
  if (state.attachment) message.image = state.attachment;
  conversation.messages.push(message);
  if (conversation.title === "New chat") conversation.title = (text || "Image").slice(0, 48);
  $("prompt").value = "";
  clearAttachment();
  complete(conversation);
}

function regenerate() {
  const conversation = current();
  if (!conversation || state.controller) return;
  while (conversation.messages.length && conversation.messages[conversation.messages.length - 1].role === "assistant") {
    conversation.messages.pop();
  }
  if (conversation.messages.length) complete(conversation);
}

function attach(event) {
  const file = event.target.files[0];
  event.target.value = "";
  if (!file) return;
  if (!file.type.startsWith("image/")) {
    setStatus("Not an image: " + file.name);
    return;
  }
  const reader = new FileReader();
  reader.onload = () =>
    shrink(reader.result, file.size).then((url) => {
      state.attachment = url;
      $("attachment-preview").src = url;
      $("attachment").hidden = false;
    });
  reader.readAsDataURL(file);
}

// A photo straight from a camera is several MB, more than the server's body limit (--max-request-body-mb)
// and the browser's storage take; models see a few hundred pixels a side anyway. Large images are redrawn
// at most MAX_SIDE pixels a side, as JPEG; small ones go as they are.
const MAX_SIDE = 1536;
function shrink(url, bytes) {
  return new Promise((resolve) => {
    const img = new Image();
    img.onload = () => {
      const scale = Math.min(1, MAX_SIDE / Math.max(img.naturalWidth, img.naturalHeight));
      if (scale === 1 && bytes < 2 * 1024 * 1024) return resolve(url);
      const canvas = document.createElement("canvas");
      canvas.width = Math.round(img.naturalWidth * scale);
      canvas.height = Math.round(img.naturalHeight * scale);
      canvas.getContext("2d").drawImage(img, 0, 0, canvas.width, canvas.height);
      resolve(canvas.toDataURL("image/jpeg", 0.9));
    };
    img.onerror = () => resolve(url); // let the server say what is wrong with it
    img.src = url;
  });
}

function clearAttachment() {
  state.attachment = null;
  $("attachment").hidden = true;
  $("attachment-preview").removeAttribute("src");
}

function init() {
  // the empty-chat hint, kept aside as a template for render() to clone
  const template = document.createElement("template");
  template.id = "empty-template";
  template.content.append($("empty"));
  document.body.append(template);

  state.conversations = load(STORE, []);
  state.currentId = localStorage.getItem(CURRENT) || null;
  if (!current()) state.currentId = state.conversations.length ? state.conversations[0].id : null;
  for (const c of state.conversations) {
    for (const m of c.messages) if (m.state === "streaming") m.state = "stopped"; // the page closed mid-stream
  }
  restoreSettings();

  $("composer").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) send(e);
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("regenerate").addEventListener("click", regenerate);
  $("new-chat").addEventListener("click", newConversation);
  $("attach").addEventListener("change", attach);
  $("remove-attachment").addEventListener("click", clearAttachment);
  for (const id of ["model", "system", "temperature", "top-p", "max-tokens", "api-key"]) {
    $(id).addEventListener("change", saveSettings);
  }
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    keyGiven(true);
  });
  $("key-cancel").addEventListener("click", () => keyGiven(false));
  $("key-dialog").addEventListener("cancel", () => keyGiven(false));
  render();
  loadModels();
}

document.addEventListener("DOMContentLoaded", init);
