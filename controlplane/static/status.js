// Ponto status page: polls /api/status every 2 s and renders it.
// Every name from the API is set with textContent (never innerHTML), so a
// region called <script> is shown, not run. The admin token is kept in
// sessionStorage and sent as a header, never a cookie. Every change carries
// X-Ponto-Request: 1, which a form from another site cannot send and a
// script from another site may not (the port grants no CORS preflight), so
// another site cannot drain anything through this browser, token or not.
"use strict";

const POLL_MS = 2000;
// A read or a change not answered by then fails, said as a refused one is: a
// stalled control plane (a stopped process, a paused VM) had left the page
// showing its last status as current, polling no more (trial 22).
// Members, not constants: the browser tests shorten them rather than wait.
const WITHIN_MS = { status: 5000, change: 10000 };
const TOKEN_KEY = "ponto-admin-token";
const SVG = "http://www.w3.org/2000/svg";
let writes = "open";
let pending = null; // the action waiting for the token form
let timer = null;
let unreachable = false; // the last poll failed and said so

async function fetchWithin(url, options, ms) {
  try {
    return await fetch(url, { ...options, signal: AbortSignal.timeout(ms) });
  } catch (error) {
    if (error.name === "TimeoutError") throw new Error(`no answer in ${ms / 1000} s`);
    throw error;
  }
}

function el(tag, attrs, ...children) {
  const node = tag.startsWith("svg:")
    ? document.createElementNS(SVG, tag.slice(4))
    : document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value !== undefined && value !== null) node.setAttribute(name, String(value));
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(typeof child === "string" ? document.createTextNode(child) : child);
  }
  return node;
}

function rate(value) {
  return value === null || value === undefined ? "–" : value.toFixed(value < 10 ? 1 : 0);
}

// A rate that may be small (a refusal now and then): two decimals below 1/s;
// a dash while unknown.
function fineRate(value) {
  if (value === null || value === undefined) return "–";
  return `${value < 1 ? value.toFixed(2) : rate(value)}/s`;
}

// The title of a tenant's or a region's rate while it is unknown.
const UNKNOWN_RATE = "not known yet: a proxy counted some before this replica first read "
  + "its reports (it just connected, or the replica just started); known with its next report";

// Its title while etcd does not answer (render sets storeAway): the reason
// above would be wrong then (review 291).
const AWAY_RATE = "not known: the state store (etcd), which holds the proxies' reports, "
  + "does not answer";
let storeAway = false;

function unknownRate() {
  return storeAway ? AWAY_RATE : UNKNOWN_RATE;
}

function limitCell(value, attrs) {
  const unknown = value === null || value === undefined;
  return el("td", unknown ? { ...attrs, class: "unknown", title: unknownRate() } : attrs,
    fineRate(value));
}

// A region's rate in a line of text: a dash with the reason on hover while
// unknown (in the map's SVG, a tspan whose title is the tooltip).
function regionRate(value, svg) {
  if (value !== null && value !== undefined) return rate(value);
  return svg
    ? el("svg:tspan", { class: "unknown" }, el("svg:title", {}, unknownRate()), rate(value))
    : el("span", { class: "unknown", title: unknownRate() }, rate(value));
}

function percent(value) {
  return value === null || value === undefined ? "–" : `${Math.round(value * 100)}%`;
}

function age(seconds) {
  if (seconds < 60) return `${seconds.toFixed(0)} s ago`;
  if (seconds < 3600) return `${(seconds / 60).toFixed(0)} min ago`;
  return `${(seconds / 3600).toFixed(1)} h ago`;
}

// tone: "ok", "warn" (done, but see why) or "error".
function say(text, tone) {
  const box = document.getElementById("message");
  box.textContent = text;
  box.className = tone;
  box.hidden = !text;
}

// What a region's card says of each state (regionState).
const STATE_TEXT = {
  ok: "serving", degraded: "degraded", down: "down", idle: "no origin", drained: "drained",
};

function regionState(region) {
  if (region.drained) return "drained";
  const serving = region.origins.filter((o) => !o.drained);
  const healthy = serving.filter((o) => o.healthy);
  // Every origin drained, or none yet: nothing to serve (review 46).
  if (!serving.length) return "idle";
  if (!healthy.length) return "down";
  // One the proxies ejected passes its probes but fails their requests.
  const clean = healthy.filter((o) => !o.ejected);
  return clean.length < serving.length ? "degraded" : "ok";
}

function actionButton(kind, name, drained) {
  const verb = drained ? "undrain" : "drain";
  const button = el("button", {
    type: "button",
    "data-action": verb,
    "data-kind": kind,
    "data-name": name,
  }, drained ? "Undrain" : "Drain");
  button.disabled = writes === "off";
  button.addEventListener("click", () => act(kind, name, verb));
  return button;
}

function renderMarkers(regions) {
  const group = document.getElementById("markers");
  const markers = regions.map((r) => {
    const x = r.longitude + 180;
    const y = 90 - r.latitude;
    const state = regionState(r);
    return el("svg:g", { class: `marker ${state}`, "data-region": r.name },
      el("svg:title", {}, `${r.name}: ${state}`),
      el("svg:circle", { cx: x, cy: y, r: 3 }),
      el("svg:text", { x: x + 4.2, y: y + 1.8 }, r.name),
      el("svg:text", { class: "rate", x: x + 4.2, y: y + 7 },
        "served ", regionRate(r.served_per_s, true), " req/s · ",
        regionRate(r.served_errors_per_s, true), " err/s"),
      r.proxies // 0: none there; null: not known (the state store is unavailable)
        ? el("svg:text", { class: "rate", x: x + 4.2, y: y + 12.2 },
          "arrived ", regionRate(r.requests_per_s, true), " req/s")
        : null);
  });
  group.replaceChildren(...markers);
}

// An origin's state: drained, unhealthy by the probes, failing (the probes
// pass, or none are made, but proxies ejected it for failing their requests),
// not probed (probing is off: nothing says it is healthy but the proxies'
// silence), or healthy.
function originState(o) {
  if (o.drained) return "drained";
  if (!o.healthy) return "unhealthy";
  if (o.ejected) return "failing";
  return o.probed === false ? "not probed" : "healthy";
}

function originLoad(o) {
  // No figures read (trial 66: "0 / 4 (0%)" on a busy llama.cpp origin
  // looked like a scraped idle one).
  const unread = o.server && o.server !== "unknown"
    ? `no load metrics from ${o.server}` : "no load metrics";
  const parts = [o.inflight === null || o.inflight === undefined
    ? (o.capacity ? `${unread} (capacity ${o.capacity})` : unread)
    : o.capacity
      ? `${o.inflight.toFixed(0)} / ${o.capacity} (${percent(o.load)})`
      : `${o.inflight.toFixed(0)} in flight`];
  if (o.waiting) parts.push(`${o.waiting.toFixed(0)} queued`);
  if (o.kv_cache_usage !== null && o.kv_cache_usage !== undefined) {
    parts.push(`KV ${percent(o.kv_cache_usage)}`);
  }
  if (o.prefix_hit_rate !== null && o.prefix_hit_rate !== undefined) {
    parts.push(`prefix hits ${percent(o.prefix_hit_rate)}`);
  }
  if (o.server && o.server !== "unknown" && o.inflight !== null && o.inflight !== undefined) {
    parts.push(o.server);
  }
  return parts.join(" · ");
}

// A proxy whose registration went with its control-plane replica: it may
// still serve from its last table (trial 49: its region read "no proxy in
// this region" while it served).
const DEPARTED = "its control-plane replica is gone: it may still serve from its last table";

function departedIn(departed, region) {
  const gone = departed.filter((p) => p.region === region);
  return gone.length
    ? `no proxy connected now: ${gone.map((p) => `${p.name} left ${age(p.left_s)}`).join(", ")} (${DEPARTED})`
    : "no proxy in this region: clients arrive elsewhere";
}

function renderRegions(regions, departed) {
  const cards = regions.map((r) => {
    const origins = r.origins.map((o) => el("tr", { "data-origin": o.name },
      el("td", {}, o.name),
      el("td", {}, el("span", { class: `state ${originState(o).replace(" ", "-")}` },
        originState(o)),
        // Why, where the operator looks (trial 27: a tooltip of the load cell only);
        // a healthy origin's says what its probe proved (a 401 to a probe without a key).
        o.detail ? el("span", { class: o.healthy ? "why note" : "why" }, o.detail) : null,
        // What the proxies saw of its requests, which probes of /health miss.
        o.ejected ? el("span", { class: "why failing" }, o.ejected) : null),
      el("td", { title: o.detail }, originLoad(o),
        o.continuation_warning
          ? el("span", { class: "why failing" }, o.continuation_warning) : null),
      el("td", {}, actionButton("origins", o.name, o.drained))));
    // The map marker's state, in words (trial 27: "serving" with every origin down).
    const state = regionState(r);
    return el("article", { class: `region${r.drained ? " drained" : ""}`, "data-region": r.name },
      el("h3", {}, el("span", { class: "name" }, r.name),
        el("span", { class: `state ${state}`, "data-state": state }, STATE_TEXT[state]),
        actionButton("regions", r.name, r.drained)),
      el("p", { class: "served", title: "requests this region served, wherever clients arrived "
        + "(its origins; cache answers count where the proxy is; requests the proxy "
        + "refused itself are no region's errors: they are the 4xx of where they arrived)" },
        "served ", regionRate(r.served_per_s), " req/s · ", regionRate(r.served_errors_per_s),
        " errors/s"),
      el("p", { class: "rates", title: "requests that arrived at this region's proxies" },
        ...(r.proxies === null
          ? [STORE_AWAY_PROXIES]
          : r.proxies
            ? ["arrived ", regionRate(r.requests_per_s), " req/s · ",
              regionRate(r.server_errors_per_s), " 5xx/s · ", regionRate(r.client_errors_per_s),
              ` 4xx/s at ${r.proxies} prox${r.proxies === 1 ? "y" : "ies"}`]
            : [departedIn(departed, r.name)])),
      el("p", { class: "where" },
        `load: ${r.load === null ? "n/a (no capacity set)" : percent(r.load)}`
          + ` · at ${r.latitude.toFixed(1)}°, ${r.longitude.toFixed(1)}°`),
      el("table", {},
        el("thead", {}, el("tr", {}, el("th", {}, "origin"), el("th", {}, "health"),
          el("th", {}, "load"), el("th", {}, ""))),
        el("tbody", {}, ...origins)));
  });
  document.getElementById("regions").replaceChildren(...cards);
}

// What stands for the proxies, their rates and the replicas while etcd, which
// alone holds them, does not answer (state_store.available false: they are
// null, not none).
const STORE_AWAY_PROXIES = "proxies and their rates not known: the state store is unavailable";

function renderProxies(proxies, departed) {
  if (proxies === null) {
    const unknown = el("tr", { class: "unknown" },
      el("td", { colspan: 8, class: "none" },
        "Not known while the state store is unavailable: the registrations are in it. "
        + "The proxies keep serving their last tables."));
    document.querySelector("#proxies tbody").replaceChildren(unknown);
    return;
  }
  const left = departed.map((p) => el("tr", { "data-proxy": p.name, class: "departed" },
    el("td", {}, p.name),
    el("td", {}, p.region),
    el("td", {}, p.replica),
    el("td", {}, "-"),
    el("td", { class: "stale" }, `left ${age(p.left_s)}`),
    el("td", {}, p.address),
    el("td", {}, ""),
    el("td", { class: "problems" }, `not registered: ${DEPARTED}`)));
  const rows = proxies.map((p) => el("tr", { "data-proxy": p.name },
    el("td", {}, p.name),
    el("td", {}, p.region),
    el("td", {}, p.replica),
    p.unknown
      // Its replica's word may be stale (it hangs, or died): not shown current.
      ? el("td", { class: "behind", "data-acked": p.acked_version, title: p.unknown },
        `${p.acked_version}? unknown: ${p.unknown}`)
      : el("td", { class: p.latest ? "current" : "behind", "data-acked": p.acked_version },
        p.latest ? `${p.acked_version} (latest)` : `${p.acked_version} of ${p.current_version}`),
    el("td", heardCell(p), age(p.age_s)),
    el("td", {}, p.address),
    el("td", {}, p.version),
    el("td", { class: "problems" }, problems(p))));
  document.querySelector("#proxies tbody").replaceChildren(...rows, ...left);
}

// How a proxy's "heard" cell looks: muted, with why, when its route stream
// may be gone (its replica stopped renewing) or it merely had no traffic (a
// connected idle proxy reports no change, so its age grows).
function heardCell(p) {
  if (p.stale) return { class: "stale", title: "its replica stopped renewing: its stream may be gone" };
  if (p.quiet) return { class: "quiet", title: "no traffic since: a quiet proxy reports nothing" };
  return {};
}

// Why a proxy is behind, or what it cannot use of the table it serves; one
// line each.
function problems(p) {
  const lines = [];
  if (p.last_error) lines.push(`refused the last table: ${p.last_error}`);
  for (const w of Array.isArray(p.warnings) ? p.warnings : []) lines.push(w);
  return lines.join("\n");
}

// The warnings every Admin write (pontoctl) carries while they last: shown
// above the page, so an operator sees them without writing anything.
function renderFleetWarnings(warnings) {
  const list = document.getElementById("fleet-warnings");
  list.replaceChildren(...warnings.map((w) => el("li", {}, `warning: ${w}`)));
  list.hidden = !warnings.length;
}

function tenantLimits(t) {
  const parts = [];
  if (t.rpm) parts.push(`${t.rpm} req/min`);
  if (t.tpm) parts.push(`${t.tpm} tokens/min`);
  if (t.concurrency) parts.push(`${t.concurrency} at once`);
  if (t.tokens_per_day) parts.push(`${t.tokens_per_day} tokens/day`);
  if (t.tokens_per_month) parts.push(`${t.tokens_per_month} tokens/month`);
  return parts.length ? parts.join(" · ") : "none (its keys' limits)";
}

function renderLimits(tenants) {
  document.getElementById("limits-unknown").hidden = tenants !== null;
  if (tenants === null) { // not known: the state store is unavailable
    document.getElementById("limits").hidden = true;
    document.getElementById("limits-none").hidden = true;
    return;
  }
  const rows = tenants.map((t) => el("tr", { "data-tenant": t.name },
    el("td", {}, t.name),
    limitCell(t.refused_per_s, { class: t.refused_per_s ? "refused" : "" }),
    limitCell(t.slot_waits_per_s, {}),
    el("td", {}, tenantLimits(t))));
  document.querySelector("#limits tbody").replaceChildren(...rows);
  document.getElementById("limits").hidden = !rows.length;
  document.getElementById("limits-none").hidden = rows.length > 0;
}

// A Unix time as pontoctl prints it (2026-12-06T20:55:01Z).
function utc(seconds) {
  return new Date(seconds * 1000).toISOString().replace(/\.\d+Z$/, "Z");
}

const NO_SINCE = "suspended by a control plane that kept no time: when is not known";

// When a tenant or key was suspended, and how long ago; "–" when not known.
function since(at, now) {
  return at
    ? el("td", { title: utc(at) }, `${utc(at)} (${age(Math.max(0, now - at))})`)
    : el("td", { title: NO_SINCE }, "–");
}

// The operator's reason, as text; with no time either, the suspension was
// made by (or is read through) a control plane older than reasons.
function reasonCell(reason, at) {
  return reason
    ? el("td", { class: "reason" }, reason)
    : el("td", { class: "none" }, at ? "no reason given" : "not known (an older control plane's)");
}

// The suspended tenants, then keys (the API's most recent first), one row
// each; the section shows only while something is. A reason is an
// operator's free text: set as text, as every name is.
function renderSuspended(suspended, now) {
  const tenants = suspended.tenants || [];
  const keys = suspended.keys || [];
  const rows = [
    ...tenants.map((t) => el("tr", { "data-suspended-tenant": t.name },
      el("td", {}, t.name),
      el("td", { class: "all" }, "all its callers (403 tenant_suspended)"),
      since(t.since, now),
      reasonCell(t.reason, t.since))),
    ...keys.map((k) => el("tr", { "data-suspended-key": k.id },
      el("td", {}, k.tenant),
      el("td", {}, k.id,
        // What must be undone besides: a key resumed alone would serve nothing.
        k.tenant_suspended
          ? el("span", { class: "why note" }, "its tenant is suspended too") : null,
        k.expired ? el("span", { class: "why note" }, "expired too") : null),
      since(k.since, now),
      reasonCell(k.reason, k.since))),
  ];
  document.querySelector("#suspended tbody").replaceChildren(...rows);
  const more = [];
  if (suspended.more_tenants) more.push(`${suspended.more_tenants} more tenants (\`pontoctl get tenants\`)`);
  if (suspended.more_keys) more.push(`${suspended.more_keys} more keys, suspended earlier (\`pontoctl key list\`)`);
  const note = document.getElementById("suspended-more");
  note.textContent = more.length ? `Not listed here: ${more.join(" and ")}.` : "";
  note.hidden = !more.length;
  document.getElementById("suspended-section").hidden = !rows.length && !more.length;
}

// The banner while etcd does not answer: what the page still shows is this
// replica's latest table (trial 73: the page had gone blank).
function renderStore(store, status) {
  const banner = document.getElementById("store");
  const away = Boolean(store) && store.available === false;
  storeAway = away;
  banner.hidden = !away;
  if (!away) return;
  const since = store.since ? ` since ${utc(store.since)} (${age(Math.max(0, status.now - store.since))})` : "";
  // A replica that has built no table since it started knows nothing of the
  // fleet: an empty page is no empty fleet (review 291).
  const shown = status.latest_version
    ? "regions, origins, health, drains and suspensions below are this replica's latest table "
      + `(version ${status.latest_version}), and origins' load its last reading before the outage; `
    : "this replica has built no table since it started, so nothing below is known of the fleet; ";
  banner.textContent = `The state store (etcd) is unavailable${since}: ${shown}`
    + "proxies, replicas, the leader and rates are not known, and drains cannot be written. "
    + `(${store.error})`;
}

function render(status) {
  writes = status.writes;
  renderStore(status.state_store, status);
  document.getElementById("replica").textContent = status.replica;
  document.getElementById("leader").textContent = status.leader === null
    ? "not known" : status.leader || "(election)";
  document.getElementById("latest").textContent = String(status.latest_version);
  document.getElementById("updated").textContent = new Date(status.now * 1000).toLocaleTimeString();
  const note = document.getElementById("writes");
  note.className = writes;
  note.textContent = {
    token: "Drain and undrain need the admin token.",
    open: "No admin token is configured: anyone who reaches this page can drain and undrain.",
  }[writes] || status.writes_off;
  document.getElementById("token-forget").hidden = !sessionStorage.getItem(TOKEN_KEY);
  renderMarkers(status.regions);
  renderRegions(status.regions, status.departed || []);
  renderProxies(status.proxies, status.departed || []);
  renderFleetWarnings(status.fleet_warnings || []);
  renderLimits(status.tenants === undefined ? [] : status.tenants);
  // None from a replica older than the section.
  renderSuspended(status.suspended || {}, status.now);
  // The rates' window: three of the replicas' report writes (--traffic-interval-ms).
  if (status.rates_window_s) {
    document.getElementById("rates-window").textContent = String(Math.round(status.rates_window_s));
  }
  document.body.dataset.loaded = "true";
}

// A click is a press and a release on one element: a status rendered between
// the two would replace the button pressed, and the click would be lost
// (trial 27). While a button is held, the newest status waits; it is
// rendered once the release's click has run.
let held = null;

document.addEventListener("pointerdown", (event) => {
  if (event.target instanceof Element && event.target.closest("button")) held = held || {};
});
document.addEventListener("pointerup", () => {
  setTimeout(() => {
    const waiting = held && held.status;
    held = null;
    if (waiting) render(waiting);
  }, 0);
});

function show(status) {
  if (held) held.status = status;
  else render(status);
}

// Why the status API refused a read: its own message (the OpenAI-style
// {"error": {"message"}} the API answers with, e.g. "state store unavailable:
// ...") and the status, or the status alone for a body that is not the API's
// (a gateway's page). The status alone had hidden why (trial 189).
async function refusal(response) {
  const body = await response.json().catch((error) => {
    if (error.name === "TimeoutError") throw error; // a stalled body: no answer
    return null;
  });
  const message = body && body.error && body.error.message;
  return message ? `${message} (status ${response.status})` : `status ${response.status}`;
}

async function poll() {
  clearTimeout(timer);
  try {
    const response = await fetchWithin("/api/status", { cache: "no-store" }, WITHIN_MS.status);
    if (!response.ok) throw new Error(await refusal(response));
    show(await response.json());
    if (unreachable) say("", "ok");
    unreachable = false;
  } catch (error) {
    // A body that stalls after its head times out as the head would.
    const why = error.name === "TimeoutError" ? `no answer in ${WITHIN_MS.status / 1000} s` : error.message;
    say(`Cannot read the status: ${why}`, "error");
    unreachable = true;
  } finally {
    timer = setTimeout(poll, POLL_MS);
  }
}

function askToken(action) {
  pending = action;
  const form = document.getElementById("token-form");
  form.hidden = false;
  document.getElementById("token-input").focus();
}

async function act(kind, name, verb) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (writes === "token" && token === null) {
    askToken(() => act(kind, name, verb));
    return;
  }
  const headers = { "X-Ponto-Request": "1" };
  if (token) headers.Authorization = `Bearer ${token}`;
  try {
    const response = await fetchWithin(
      `/api/${kind}/${encodeURIComponent(name)}/${verb}`, { method: "POST", headers },
      WITHIN_MS.change);
    const body = await response.json().catch((error) => {
      // A body that stalls after its head is no answer, not an empty one.
      if (error.name === "TimeoutError") throw new Error(`no answer in ${WITHIN_MS.change / 1000} s`);
      return {};
    });
    if (!response.ok) {
      if (response.status === 401 || response.status === 403) sessionStorage.removeItem(TOKEN_KEY);
      const message = body.error && body.error.message ? body.error.message : response.statusText;
      say(`${verb} ${name} refused (${response.status}): ${message}`, "error");
      return;
    }
    // Done, but what the control plane warns of (a model left with no
    // undrained origin, say), as pontoctl prints it: one line each.
    const warnings = Array.isArray(body.warnings) ? body.warnings : [];
    const done = body.drained ? "drained" : "undrained";
    say([body.changed === false ? `${name} is already ${done}: nothing changed` : `${name} ${done}`,
      ...warnings.map((w) => `warning: ${w}`)].join("\n"), warnings.length ? "warn" : "ok");
  } catch (error) {
    // Sent but not answered: it may have been done all the same.
    const maybe = error.message.startsWith("no answer") ? " (it may be done all the same)" : "";
    say(`${verb} ${name} failed: ${error.message}${maybe}`, "error");
  }
  poll();
}

document.getElementById("token-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const input = document.getElementById("token-input");
  sessionStorage.setItem(TOKEN_KEY, input.value.trim());
  input.value = "";
  event.target.hidden = true;
  const action = pending;
  pending = null;
  if (action) action();
});

document.getElementById("token-cancel").addEventListener("click", () => {
  pending = null;
  document.getElementById("token-form").hidden = true;
});

document.getElementById("token-forget").addEventListener("click", () => {
  sessionStorage.removeItem(TOKEN_KEY);
  say("Admin token forgotten", "ok");
  poll();
});

poll();
