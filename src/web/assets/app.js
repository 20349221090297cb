// zhihui's one page module: the live socket (task progress, claim results), countdowns, the
// price beside the form, the seed field. Text the user typed or a server sent is only ever
// set with textContent. No inline script anywhere: the Content-Security-Policy forbids it.

const body = document.body;
const lang = body.dataset.lang || "zh";
const baseTitle = document.title;

function csrfToken() {
  try {
    return JSON.parse(body.getAttribute("hx-headers") || "{}")["X-CSRF-Token"] || "";
  } catch {
    return "";
  }
}

function fill(template, values) {
  return template.replace(/\{(\w+)\}/g, (whole, name) => (name in values ? String(values[name]) : whole));
}

// One clock per page: a time drawn here is in the zone the server drew the page in (the
// browser's own once it has told it, else the platform's, then named), in the server's format.
const pageOffset = body.dataset.tzOffset ? Number(body.dataset.tzOffset) : NaN;
const zoneLabel = body.dataset.tzLabel || "";

function timeText(iso) {
  const at = new Date(iso);
  if (Number.isNaN(at.getTime())) return "";
  const offset = Number.isFinite(pageOffset) ? pageOffset : -at.getTimezoneOffset();
  const shifted = new Date(at.getTime() + offset * 60000);
  const two = (n) => String(n).padStart(2, "0");
  const text = `${shifted.getUTCFullYear()}-${two(shifted.getUTCMonth() + 1)}-${two(shifted.getUTCDate())} ${two(shifted.getUTCHours())}:${two(shifted.getUTCMinutes())}`;
  return zoneLabel ? `${text} (${zoneLabel})` : text;
}

// The browser's zone, remembered for the pages drawn next (minutes east of UTC).
{
  const minutes = -new Date().getTimezoneOffset();
  if (!document.cookie.split("; ").includes(`tz=${minutes}`)) {
    const secure = window.location.protocol === "https:" ? "; Secure" : "";
    document.cookie = `tz=${minutes}; Path=/; Max-Age=31536000; SameSite=Lax${secure}`;
  }
}

function field(card, name) {
  return card.querySelector(`[data-field="${name}"]`);
}

function show(element, text) {
  if (!element) return;
  if (text !== undefined) element.textContent = text;
  element.hidden = false;
}

function hide(element) {
  if (element) element.hidden = true;
}

function refreshCard(taskId) {
  const card = document.getElementById(`task-${taskId}`);
  if (card && window.htmx) {
    window.htmx.ajax("GET", `/tasks/${taskId}/card`, { target: card, swap: "outerHTML" });
  }
}

function balanceChanged() {
  if (window.htmx) window.htmx.trigger(body, "balance-changed");
}

// A card still waiting in the queue: only such a card shows a place. A place read before the
// task left the queue can arrive after the news that it left; it is not shown.
function waitsInQueue(card) {
  return card.dataset.status === "submitted" || card.dataset.status === "queued";
}

// Tasks the socket said had ended. A card drawn from an answer that left the server before the
// end (the cancel button's own answer, arriving after the news) is drawn again when it lands.
const ended = new Set();

function taskEnded(notice) {
  document.title = baseTitle;
  ended.add(notice.task_id);
  refreshCard(notice.task_id);
  balanceChanged();
}

function redrawIfEnded(element) {
  const cards = element.matches?.("article.task[data-task-id]")
    ? [element]
    : [...(element.querySelectorAll?.("article.task[data-task-id]") ?? [])];
  for (const card of cards) {
    if (ended.has(card.dataset.taskId) && !FINAL.has(card.dataset.status)) refreshCard(card.dataset.taskId);
  }
}

// A task of the reader's queued since the socket opened (through another tab, or a program's
// key): a list of the newest tasks shows its card on top. The tab that submitted it may draw the
// same card from its own answer, before or after this one lands.
async function showSubmitted(notice, card) {
  const list = document.querySelector("[data-live-tasks]");
  if (card || !list || !window.htmx) return;
  let html;
  try {
    const response = await fetch(`/tasks/${notice.task_id}/card`, { credentials: "same-origin" });
    if (!response.ok) return;
    html = await response.text();
  } catch {
    return;
  }
  if (document.getElementById(`task-${notice.task_id}`)) return;
  list.parentElement?.querySelector(":scope > p.empty")?.remove();
  list.insertAdjacentHTML("afterbegin", html);
  window.htmx.process(list.firstElementChild);
}

// A card swapped into a list that shows it already (the submitting tab's answer landing after
// the socket's card): the one on top stays, in the same turn as the swap, so that no reader,
// person or script, ever sees the task twice.
function dropTwins() {
  const seen = new Set();
  for (const card of document.querySelectorAll("article.task[data-task-id]")) {
    if (seen.has(card.id)) card.remove();
    else seen.add(card.id);
  }
}

const handlers = {
  submitted: showSubmitted,
  position(notice, card) {
    if (!card || !waitsInQueue(card)) return;
    show(field(card, "position"), fill(card.dataset.positionTemplate, { position: notice.position }));
    // Paying to move ahead is offered only with someone ahead: a card that moved to or from the
    // front is drawn again with its buttons.
    const offered = Boolean(card.querySelector('[hx-post$="/prioritise"]'));
    if (card.dataset.status === "queued" && offered !== notice.position > 1) refreshCard(notice.task_id);
    if (notice.estimated_start_at) {
      show(field(card, "estimate"), fill(card.dataset.estimateTemplate, { start: timeText(notice.estimated_start_at) }));
    }
  },
  // Sent to a server (which one is on the card the server draws), or out of the queue some
  // other way: the card is drawn again from the task's own events.
  dispatched(notice, card) {
    if (!card) return;
    card.dataset.status = "dispatched";
    hide(field(card, "position"));
    hide(field(card, "estimate"));
    refreshCard(notice.task_id);
  },
  left_queue(notice, card) {
    if (!card || !waitsInQueue(card)) return;
    card.dataset.status = "";
    hide(field(card, "position"));
    hide(field(card, "estimate"));
    refreshCard(notice.task_id);
  },
  progress(notice, card) {
    if (!card) return;
    const max = Number(notice.max) || 1;
    const value = Math.min(Number(notice.value) || 0, max);
    const percent = Math.round((value / max) * 100);
    card.dataset.status = "running";
    hide(field(card, "position"));
    hide(field(card, "estimate"));
    show(field(card, "status"), card.dataset.runningText);
    if (card.dataset.server) {
      show(field(card, "server"), fill(card.dataset.runningOnTemplate, { server: card.dataset.server }));
      field(card, "server")?.classList.remove("warning");
    } else if (!card.dataset.askedServer) {
      // Drawn before it was sent to a server (its "dispatched" came before the card was on the
      // page): drawn again once, from its events, to say where it runs.
      card.dataset.askedServer = "1";
      refreshCard(notice.task_id);
    }
    const bar = field(card, "progress");
    if (bar) {
      bar.max = max;
      bar.value = value;
    }
    show(field(card, "progress-row"));
    show(field(card, "percent"), `${percent}%`);
    document.title = `${percent}% · ${baseTitle}`;
  },
  // Its server stopped answering: said in place of where it runs until the server is back
  // (its progress again) or the task ends.
  server_lost(notice, card) {
    if (!card || !card.dataset.server) return;
    const line = field(card, "server");
    if (!line) return;
    show(line, fill(card.dataset.serverLostTemplate, { server: card.dataset.server }));
    line.classList.add("warning");
  },
  succeeded: taskEnded,
  failed: taskEnded,
  cancelled: taskEnded,
  points_credited() {
    balanceChanged();
  },
  claim_granted(notice) {
    showClaim(notice.promotion_id, "success", (claim) => claim.dataset.grantedText);
    balanceChanged();
  },
  claim_refused(notice) {
    showClaim(notice.promotion_id, "error", (claim) => fill(claim.dataset.refusedText, { reason: notice.reason || "" }));
    balanceChanged();
  },
};

// A claim's result, straight from the socket (the read model may not have it yet).
function showClaim(promotionId, kind, text) {
  const claim = document.querySelector(`[data-claim="${promotionId}"]`);
  if (!claim) return;
  const line = document.createElement("p");
  line.className = `notice ${kind}`;
  line.setAttribute("role", "status");
  line.textContent = text(claim);
  claim.replaceChildren(line);
}

function refreshSale(promotionId) {
  const sale = document.getElementById(`sale-${promotionId}`);
  if (sale && window.htmx) {
    window.htmx.ajax("GET", `/sales/${promotionId}/claim`, { target: sale, swap: "outerHTML" });
  }
}

// The statuses after which a task's card never changes again.
const FINAL = new Set(["succeeded", "failed", "cancelled"]);

// The socket tells only what happens after it opens: a card drawn before (from the read model,
// which may lag its task by a moment) or while the socket was closed may have missed its task's
// end. Once subscribed, every card not yet final is drawn again from its task's own events.
function catchUp() {
  for (const card of document.querySelectorAll("article.task[data-task-id]")) {
    if (!FINAL.has(card.dataset.status)) refreshCard(card.dataset.taskId);
  }
}

// The socket tells of the tasks queued after it opens. One queued before, between the page's
// drawing and the socket's opening or while the socket was closed, is looked for among the
// reader's newest tasks once it opens: those newer than a list's top card are drawn above it,
// oldest first, so the newest ends on top.
async function catchUpSubmitted() {
  const list = document.querySelector("[data-live-tasks]");
  if (!list) return;
  const top = list.querySelector("article.task[data-task-id]")?.dataset.taskId;
  let tasks;
  try {
    const response = await fetch("/api/v1/tasks?limit=20", { credentials: "same-origin" });
    if (!response.ok) return;
    tasks = (await response.json()).tasks;
  } catch {
    return;
  }
  const newer = [];
  for (const task of tasks) {
    if (task.task_id === top) break;
    newer.push(task.task_id);
  }
  for (const taskId of newer.reverse()) {
    await showSubmitted({ task_id: taskId }, document.getElementById(`task-${taskId}`));
  }
}

// The socket: opened with a one-time ticket (the session cookie never goes into a URL), opened
// again with a growing pause when it closes.
let pause = 500;
async function openSocket() {
  let ticket;
  try {
    const response = await fetch("/api/v1/ws/ticket", {
      method: "POST",
      headers: { "X-CSRF-Token": csrfToken() },
      credentials: "same-origin",
    });
    if (response.status === 401) return; // signed out: nothing to follow
    if (!response.ok) throw new Error(`ticket: ${response.status}`);
    ticket = (await response.json()).ticket;
  } catch {
    setTimeout(openSocket, pause);
    pause = Math.min(pause * 2, 30000);
    return;
  }
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const socket = new WebSocket(`${scheme}://${location.host}/api/v1/ws?ticket=${encodeURIComponent(ticket)}`);
  socket.addEventListener("open", () => {
    pause = 500;
    body.dataset.socket = "open";
    catchUp();
    catchUpSubmitted();
  });
  socket.addEventListener("message", (event) => {
    let notice;
    try {
      notice = JSON.parse(event.data);
    } catch {
      return;
    }
    const handler = handlers[notice.type];
    if (!handler) return;
    const card = notice.task_id ? document.getElementById(`task-${notice.task_id}`) : null;
    handler(notice, card);
  });
  socket.addEventListener("close", () => {
    body.dataset.socket = "closed";
    setTimeout(openSocket, pause);
    pause = Math.min(pause * 2, 30000);
  });
}

// Countdowns to a sale's start or end, every second.
function tickCountdowns() {
  const now = Date.now();
  for (const element of document.querySelectorAll("[data-countdown]")) {
    const left = Math.max(0, Date.parse(element.dataset.countdown) - now);
    const seconds = Math.floor(left / 1000);
    const days = Math.floor(seconds / 86400);
    const clock = [Math.floor((seconds % 86400) / 3600), Math.floor((seconds % 3600) / 60), seconds % 60]
      .map((part) => String(part).padStart(2, "0"))
      .join(":");
    element.textContent = days > 0 ? `${days}${lang === "zh" ? " 天 " : "d "}${clock}` : clock;
    if (left === 0 && !element.dataset.done) {
      element.dataset.done = "1";
      const sale = element.closest("[data-promotion-id]");
      if (sale) refreshSale(sale.dataset.promotionId);
    }
  }
}

// A send-code button that may not be pressed again yet counts the seconds down on itself,
// then is free again (the server refuses an earlier send anyway).
function waitButtons(root) {
  for (const button of root.querySelectorAll?.("button[data-wait]") ?? []) {
    if (button.dataset.waiting) continue;
    button.dataset.waiting = "1";
    const until = Date.now() + Number(button.dataset.wait) * 1000;
    const tick = () => {
      const left = Math.ceil((until - Date.now()) / 1000);
      button.disabled = left > 0;
      button.textContent = left > 0 ? fill(button.dataset.waitText, { seconds: left }) : button.dataset.readyText;
      if (left > 0) setTimeout(tick, 250);
    };
    tick();
  }
}

// The price beside the form: images × price per image.
function updatePrice() {
  const form = document.getElementById("generate-form");
  const price = document.getElementById("price");
  const images = document.getElementById("images");
  if (!form || !price || !images) return;
  const total = Number(form.dataset.pricePerImage) * Number(images.value || 1);
  price.textContent = fill(form.dataset.priceTemplate, { price: total.toFixed(2) });
}

// The seed field is only for a fixed seed.
function updateSeed() {
  const seed = document.getElementById("seed");
  const fixed = document.querySelector('input[name="seed_mode"][value="fixed"]');
  if (!seed || !fixed) return;
  seed.disabled = !fixed.checked;
  seed.required = fixed.checked;
}

document.addEventListener("change", (event) => {
  if (event.target.id === "images") updatePrice();
  if (event.target.name === "seed_mode") {
    updateSeed();
    if (event.target.value === "fixed") document.getElementById("seed")?.focus();
  }
});

document.addEventListener("htmx:afterSwap", (event) => {
  // A first card replaces the "no tasks yet" line.
  if (event.target.id === "tasks") event.target.parentElement?.querySelector(".empty")?.remove();
});

// A like or follow swaps its button for the new one (pressed or not). The old button is
// disabled while the request runs, which drops the keyboard's focus to the page: a person who
// pressed it with the keyboard gets it back on the new button, where they were.
const FOCUS_KEPT = "form.like, form.follow";
document.addEventListener("htmx:beforeRequest", (event) => {
  const form = event.detail.elt;
  if (form.matches && form.matches(FOCUS_KEPT)) form.dataset.hadFocus = form.contains(document.activeElement) ? "1" : "";
});
document.addEventListener("htmx:afterSwap", (event) => {
  const form = event.detail.elt;
  if (!form.matches || !form.matches(FOCUS_KEPT) || form.dataset.hadFocus !== "1") return;
  delete form.dataset.hadFocus;
  form.querySelector("button")?.focus();
});

// A request that failed says so, in the page's language, where its form shows its messages (or
// at the top of the page). htmx leaves the form as it was, so what the person typed stays.
function failureText(xhr) {
  const status = xhr ? xhr.status : 0;
  if (!status) return body.dataset.failedOffline;
  const type = xhr.getResponseHeader("Content-Type") || "";
  if (type.startsWith("text/html")) {
    const page = new DOMParser().parseFromString(xhr.responseText, "text/html");
    const said = page.querySelector("[data-failure], .notice");
    if (said && said.textContent.trim()) return said.textContent.trim();
  }
  if (status === 413) return body.dataset.failedTooLarge;
  if (status === 429) return body.dataset.failedTooMany;
  if (status === 502 || status === 503 || status === 504) return body.dataset.failedUnavailable;
  return fill(body.dataset.failed, { status });
}

function showFailure(element, text) {
  let region = null;
  for (let at = element; at && !region; at = at.parentElement) {
    region = at.querySelector(".messages, [id$='-messages']");
  }
  region = region || document.getElementById("page-messages");
  if (!region) return;
  const notice = document.createElement("div");
  notice.className = "notice error";
  notice.setAttribute("role", "alert");
  notice.textContent = text;
  region.replaceChildren(notice);
}

document.addEventListener("htmx:responseError", (event) => {
  showFailure(event.detail.elt, failureText(event.detail.xhr));
});
document.addEventListener("htmx:sendError", (event) => showFailure(event.detail.elt, failureText(null)));
document.addEventListener("htmx:timeout", (event) => showFailure(event.detail.elt, failureText(null)));

// A prompt being sent is kept in this tab until it is answered: a session that ended sends the
// person to sign in, and what they typed comes back with them (never to another tab or after
// the tab is closed: sessionStorage).
const DRAFT = "zhihui.generate.draft";
const DRAFT_FIELDS = ["prompt", "negative_prompt"];

function keepDraft(form) {
  const fields = {};
  for (const name of DRAFT_FIELDS) if (form.elements[name]) fields[name] = form.elements[name].value;
  sessionStorage.setItem(DRAFT, JSON.stringify(fields));
}

document.addEventListener("htmx:beforeRequest", (event) => {
  if (event.detail.elt.id === "generate-form") keepDraft(event.detail.elt);
});
// Switching the language draws the page again: what was typed comes back in the other one.
document.addEventListener("submit", (event) => {
  const form = document.getElementById("generate-form");
  if (form && event.target.matches?.("form.lang-switch")) keepDraft(form);
});
document.addEventListener("htmx:afterRequest", (event) => {
  if (event.detail.elt.id !== "generate-form" || !event.detail.successful) return;
  if (!event.detail.xhr.getResponseHeader("HX-Redirect")) sessionStorage.removeItem(DRAFT);
});

// A form that adds something (a server) is emptied once what it added is shown; a refusal comes
// back retargeted to the form's messages and leaves what was typed in place.
document.addEventListener("htmx:afterRequest", (event) => {
  const form = event.detail.elt;
  if (!form.matches || !form.matches("form[data-reset-on-success]") || !event.detail.successful) return;
  if (!event.detail.xhr.getResponseHeader("HX-Retarget")) form.reset();
});

function restoreDraft() {
  const form = document.getElementById("generate-form");
  const saved = sessionStorage.getItem(DRAFT);
  if (!form || !saved) return;
  sessionStorage.removeItem(DRAFT);
  try {
    const fields = JSON.parse(saved);
    for (const name of DRAFT_FIELDS) {
      const field = form.elements[name];
      if (field && !field.value && typeof fields[name] === "string") field.value = fields[name];
    }
  } catch {
    // A draft this page cannot read is dropped.
  }
}

// A field whose pattern is not met says the page's own rule, in the page's language, not the
// browser's "match the requested format".
for (const input of document.querySelectorAll("input[data-pattern-message]")) {
  input.addEventListener("invalid", () => {
    if (input.validity.patternMismatch) input.setCustomValidity(input.dataset.patternMessage);
  });
  input.addEventListener("input", () => input.setCustomValidity(""));
}

restoreDraft();
waitButtons(document);
if (window.htmx) window.htmx.onLoad(waitButtons);
updatePrice();
updateSeed();
if (document.querySelector("[data-countdown]")) {
  tickCountdowns();
  setInterval(tickCountdowns, 1000);
}
if (body.dataset.live === "1") {
  if (window.htmx) window.htmx.onLoad(redrawIfEnded);
  body.addEventListener("htmx:afterSwap", dropTwins);
  openSocket();
}

// A key shown once: copied with one press (the clipboard needs a secure context; elsewhere the
// key stays selected for the person to copy).
document.addEventListener("click", async (event) => {
  const button = event.target.closest?.("button[data-copy]");
  if (!button) return;
  try {
    await navigator.clipboard.writeText(button.dataset.copy);
    button.textContent = button.dataset.copied;
  } catch {
    const code = button.parentElement?.querySelector("code");
    if (code) window.getSelection()?.selectAllChildren(code);
  }
});
