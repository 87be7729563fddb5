// streamengine chat page: one WebSocket to /v1/stream, plain DOM, no build step.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const KEY_STORAGE = "streamengine.apiKey";
  const KV_POLL_BUSY_MS = 400;
  const KV_POLL_IDLE_MS = 2000;
  const KV_COLORS = ["--kv-free", "--kv-cached", "--kv-used", "--kv-shared", "--kv-pinned"];
  const KV_STATES = ["free", "cached", "used", "shared", "pinned"];
  const SHARED_OWNER = "*"; // a block several tenants hold (a shared prefix)

  const ui = {
    model: $("model"), dot: $("conn-dot"), connText: $("conn-text"), keyButton: $("key-button"),
    system: $("system"), maxTokens: $("max-tokens"), temperature: $("temperature"),
    newChat: $("new-chat"), conversation: $("conversation"), empty: $("empty"),
    composer: $("composer"), input: $("input"), send: $("send"), stop: $("stop"),
    kvCanvas: $("kv-canvas"), kvSummary: $("kv-summary"), kvUsage: $("kv-usage"),
    kvByTenant: $("kv-by-tenant"), kvByTenantLabel: $("kv-by-tenant-label"), kvTenants: $("kv-tenants"),
    keyDialog: $("key-dialog"), keyForm: $("key-form"), keyInput: $("key-input"), keyReason: $("key-reason"),
  };

  const state = {
    ws: null,
    ready: false,
    authRequired: false,
    history: [],        // [{role, content}] of finished turns
    current: null,      // the reply being streamed
    nextId: 1,
    reconnectDelay: 500,
    kvTimer: null,
    lastKv: null,
    kvDenied: false,    // the server keeps the block map for admin keys: stop asking
    // Extra sampling params merged into every request (handy from the console or tests).
    extraParams: {},
  };
  window.streamengine = state;

  // ---- connection ---------------------------------------------------------------------------

  async function start() {
    try {
      const health = await (await fetch("/health")).json();
      state.authRequired = !!health.auth_required;
    } catch (_) { /* the socket will tell */ }
    if (state.authRequired && !localStorage.getItem(KEY_STORAGE)) {
      askForKey("This server was started with --api-key.");
      return;
    }
    connect();
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const ws = new WebSocket(`${scheme}//${location.host}/v1/stream`, ["streamengine.v1"]);
    state.ws = ws;
    setStatus("connecting…", "");
    ws.onopen = () => {
      const key = localStorage.getItem(KEY_STORAGE);
      if (state.authRequired && key) ws.send(JSON.stringify({ type: "auth", key }));
    };
    ws.onmessage = (event) => onMessage(JSON.parse(event.data));
    ws.onclose = (event) => onClose(event);
  }

  function onClose(event) {
    state.ready = false;
    state.ws = null;
    clearTimeout(state.kvTimer);
    if (state.current) finishReply({ finish_reason: "disconnected" });
    updateButtons();
    if (event.code === 4001) {
      localStorage.removeItem(KEY_STORAGE);
      setStatus("API key refused", "off");
      askForKey(event.reason || "The server refused the API key.");
      return;
    }
    setStatus(event.code === 1001 ? "server went away, reconnecting…" : "disconnected, reconnecting…", "off");
    setTimeout(connect, state.reconnectDelay);
    state.reconnectDelay = Math.min(state.reconnectDelay * 2, 8000);
  }

  function askForKey(reason) {
    ui.keyReason.textContent = reason;
    ui.keyButton.hidden = false;
    if (!ui.keyDialog.open) ui.keyDialog.showModal();
  }

  ui.keyForm.addEventListener("submit", () => {
    const key = ui.keyInput.value.trim();
    if (!key) return;
    localStorage.setItem(KEY_STORAGE, key);
    ui.keyInput.value = "";
    if (state.ws) state.ws.close();
    else connect();
  });
  ui.keyButton.addEventListener("click", () => askForKey("Enter the server's API key."));

  function setStatus(text, cls) {
    ui.connText.textContent = text;
    ui.dot.className = `dot ${cls}`;
  }

  function send(message) {
    if (state.ws && state.ws.readyState === WebSocket.OPEN) state.ws.send(JSON.stringify(message));
  }

  // ---- messages from the server ---------------------------------------------------------------

  function onMessage(msg) {
    switch (msg.type) {
      case "ready":
        state.ready = true;
        state.reconnectDelay = 500;
        state.kvDenied = false; // this socket may hold another key: ask once more
        ui.model.textContent = msg.model;
        setStatus("connected", "on");
        updateButtons();
        pollKv();
        break;
      case "delta":
        if (state.current && msg.id === state.current.id) onDelta(msg);
        break;
      case "done":
        if (state.current && msg.id === state.current.id) finishReply(msg);
        break;
      case "error":
        onError(msg);
        break;
      case "kv_state":
        state.lastKv = msg;
        drawKv(msg);
        break;
    }
  }

  function onDelta(msg) {
    const reply = state.current;
    const now = performance.now();
    if (reply.firstAt === null && msg.token_ids.length) reply.firstAt = now;
    reply.lastAt = now;
    reply.tokens += msg.token_ids.length;
    reply.text += msg.text;
    reply.bubble.textContent = reply.text;
    updateMeta(reply);
    scrollDown();
  }

  // The KV map is a view of every tenant's cache: with API keys only admin keys may read it.
  const KV_REFUSED = new Set(["admin_required", "forbidden", "permission_denied"]);

  function onError(msg) {
    if (msg.code === "unknown_id") return; // a Stop that raced the end of the reply
    if (msg.id === null && KV_REFUSED.has(msg.code)) {
      // a refused kv_state poll: the chat goes on, the page just shows no block map
      state.kvDenied = true;
      clearTimeout(state.kvTimer);
      ui.kvSummary.textContent = "block map: needs an admin key on this server";
      return;
    }
    if (state.current && (msg.id === state.current.id || msg.id === null)) {
      state.current.el.classList.add("error");
      state.current.bubble.textContent = state.current.text || msg.message;
      finishReply({ finish_reason: "error" });
    } else {
      console.warn("streamengine:", msg.code, msg.message);
    }
  }

  // ---- sending ------------------------------------------------------------------------------

  ui.composer.addEventListener("submit", (event) => {
    event.preventDefault();
    const text = ui.input.value.trim();
    if (!text || !state.ready || state.current) return;
    ui.input.value = "";
    autosize();
    ask(text);
  });

  ui.input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      ui.composer.requestSubmit();
    }
  });
  ui.input.addEventListener("input", () => { autosize(); updateButtons(); });

  ui.stop.addEventListener("click", () => {
    if (state.current) send({ type: "abort", id: state.current.id });
  });

  ui.newChat.addEventListener("click", () => {
    if (state.current) send({ type: "abort", id: state.current.id });
    state.history = [];
    ui.conversation.replaceChildren(ui.empty);
    ui.empty.hidden = false;
  });

  function ask(text) {
    ui.empty.hidden = true;
    addMessage("user", text);
    state.history.push({ role: "user", content: text });
    const messages = [];
    const system = ui.system.value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push(...state.history);

    const id = `r${state.nextId++}`;
    const el = addMessage("assistant", "");
    el.classList.add("streaming");
    state.current = {
      id, el, bubble: el.querySelector(".bubble"), meta: el.querySelector(".meta"),
      text: "", tokens: 0, sentAt: performance.now(), firstAt: null, lastAt: null,
    };
    const params = {
      max_tokens: clampInt(ui.maxTokens.value, 1, 4096, 256),
      temperature: clampFloat(ui.temperature.value, 0, 2, 0.7),
      ...state.extraParams,
    };
    send({ type: "generate", id, messages, params });
    updateButtons();
    pollKv();
  }

  function finishReply(done) {
    const reply = state.current;
    if (!reply) return;
    state.current = null;
    reply.el.classList.remove("streaming");
    reply.finish = done.finish_reason;
    if (done.usage) reply.cached = done.usage.cached_prompt_tokens;
    updateMeta(reply);
    if (reply.text) state.history.push({ role: "assistant", content: reply.text });
    updateButtons();
    ui.input.focus();
  }

  // ---- rendering ----------------------------------------------------------------------------

  function addMessage(role, text) {
    const el = document.createElement("div");
    el.className = `msg ${role}`;
    const bubble = document.createElement("div");
    bubble.className = "bubble";
    bubble.textContent = text;
    el.append(bubble);
    if (role === "assistant") {
      const meta = document.createElement("div");
      meta.className = "meta";
      el.append(meta);
    }
    ui.conversation.append(el);
    scrollDown();
    return el;
  }

  function updateMeta(reply) {
    const parts = [];
    if (reply.firstAt !== null) {
      parts.push(stat("TTFT", `${Math.round(reply.firstAt - reply.sentAt)} ms`, "ttft"));
      const seconds = (reply.lastAt - reply.firstAt) / 1000;
      if (reply.tokens > 1 && seconds > 0) {
        parts.push(stat("", `${((reply.tokens - 1) / seconds).toFixed(1)} tok/s`, "tps"));
      }
      parts.push(stat("", `${reply.tokens} tokens`, "tokens"));
    } else {
      parts.push(stat("", "waiting for the first token…", "wait"));
    }
    if (reply.cached !== undefined) parts.push(stat("cached prompt", `${reply.cached} tokens`, "cached"));
    if (reply.finish) {
      const label = { stop: "finished", length: "max tokens", abort: "stopped" }[reply.finish] || reply.finish;
      parts.push(`<span class="tag" data-stat="finish">${label}</span>`);
    }
    reply.meta.innerHTML = parts.join("");
  }

  function stat(label, value, name) {
    const prefix = label ? `${label} ` : "";
    return `<span data-stat="${name}">${prefix}<b>${value}</b></span>`;
  }

  function updateButtons() {
    const busy = state.current !== null;
    ui.send.hidden = busy;
    ui.stop.hidden = !busy;
    ui.send.disabled = !state.ready || !ui.input.value.trim();
  }

  function autosize() {
    ui.input.style.height = "auto";
    ui.input.style.height = `${Math.min(ui.input.scrollHeight, 160)}px`;
  }

  function scrollDown() {
    ui.conversation.scrollTop = ui.conversation.scrollHeight;
  }

  const clampInt = (v, lo, hi, dflt) => (Number.isFinite(+v) && v !== "" ? Math.min(hi, Math.max(lo, Math.round(+v))) : dflt);
  const clampFloat = (v, lo, hi, dflt) => (Number.isFinite(+v) && v !== "" ? Math.min(hi, Math.max(lo, +v)) : dflt);

  // ---- the KV-cache map ------------------------------------------------------------------------

  function pollKv() {
    clearTimeout(state.kvTimer);
    if (!state.ready || state.kvDenied) return;
    send({ type: "kv_state" });
    state.kvTimer = setTimeout(pollKv, state.current ? KV_POLL_BUSY_MS : KV_POLL_IDLE_MS);
  }

  // Older servers send four states and no owners: every count and list is optional.
  function drawKv(kv) {
    const counts = kv.counts || {};
    for (const name of KV_STATES) $(`kv-${name}`).textContent = counts[name] || 0;
    const inUse = (counts.used || 0) + (counts.shared || 0) + (counts.pinned || 0);
    ui.kvUsage.textContent = `${((100 * inUse) / Math.max(kv.num_blocks, 1)).toFixed(1)}% in use`;
    ui.kvSummary.textContent =
      `${kv.num_blocks} blocks × ${kv.block_size} tokens = ${(kv.num_blocks * kv.block_size).toLocaleString()} token slots`;

    const canvas = ui.kvCanvas;
    const dpr = window.devicePixelRatio || 1;
    const width = canvas.clientWidth;
    const maxHeight = matchMedia("(max-width: 860px)").matches ? 150 : 240;
    const { cell, cols } = layoutGrid(kv.num_blocks, width, maxHeight);
    const rows = Math.ceil(kv.num_blocks / cols);
    const height = Math.max(rows * cell, cell);
    canvas.width = Math.round(width * dpr);
    canvas.height = Math.round(height * dpr);
    canvas.style.height = `${height}px`;
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const styles = getComputedStyle(document.documentElement);
    const colors = KV_COLORS.map((name) => styles.getPropertyValue(name).trim());
    const ownerColor = tenantColors(kv, colors);
    const gap = cell >= 6 ? 1.5 : cell >= 4 ? 1 : 0;
    const size = cell - gap;
    const radius = size >= 8 ? 2 : 0;
    for (let i = 0; i < kv.num_blocks; i++) {
      const x = (i % cols) * cell;
      const y = Math.floor(i / cols) * cell;
      ctx.fillStyle = ownerColor(i) || colors[kv.blocks.charCodeAt(i) - 48] || colors[0];
      if (radius) {
        ctx.beginPath();
        ctx.roundRect(x, y, size, size, radius);
        ctx.fill();
      } else {
        ctx.fillRect(x, y, size, size);
      }
    }
  }

  // Per block, its tenant's colour when the map is coloured by tenant (else null: by state).
  function tenantColors(kv, colors) {
    const names = Array.isArray(kv.tenants) ? kv.tenants : null;
    const owners = names && Array.isArray(kv.owners) && kv.owners.length === kv.num_blocks ? kv.owners : null;
    ui.kvByTenantLabel.hidden = !owners;
    const byTenant = owners !== null && ui.kvByTenant.checked;
    ui.kvTenants.hidden = !byTenant;
    if (!byTenant) return () => null;
    const palette = names.map((name) => (name === SHARED_OWNER ? colors[3] : hueOf(name)));
    const held = names.map(() => 0);
    for (const owner of owners) if (owner >= 0) held[owner]++;
    ui.kvTenants.replaceChildren(...names.map((name, i) => tenantItem(name, palette[i], held[i])));
    return (i) => (owners[i] >= 0 ? palette[owners[i]] : null);
  }

  function tenantItem(name, color, blocks) {
    const li = document.createElement("li");
    const swatch = document.createElement("span");
    swatch.className = "swatch";
    swatch.style.background = color;
    const label = document.createElement("span");
    label.className = "tenant-name";
    label.textContent = name; // a tenant name is text, never markup
    label.title = name;
    const count = document.createElement("b");
    count.textContent = blocks;
    li.append(swatch, label, count);
    return li;
  }

  // A stable colour per tenant name: the same bot keeps its colour across polls and reloads.
  function hueOf(name) {
    let hash = 0;
    for (let i = 0; i < name.length; i++) hash = (hash * 31 + name.charCodeAt(i)) >>> 0;
    return `hsl(${hash % 360} 65% 52%)`;
  }

  ui.kvByTenant.addEventListener("change", () => { if (state.lastKv) drawKv(state.lastKv); });

  // The largest square cell (2..18 px) that fits every block into width x maxHeight.
  function layoutGrid(n, width, maxHeight) {
    for (let cell = 18; cell > 2; cell--) {
      const cols = Math.max(1, Math.floor(width / cell));
      if (Math.ceil(n / cols) * cell <= maxHeight) return { cell, cols };
    }
    return { cell: 2, cols: Math.max(1, Math.floor(width / 2)) };
  }

  window.addEventListener("resize", () => { if (state.lastKv) drawKv(state.lastKv); });

  updateButtons();
  start();
})();
