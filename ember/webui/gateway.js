// The gateway console: fleet, charts and keys for the admin key, plus the playground (console.js).
"use strict";

const FLEET_REFRESH_MS = 2000;
const SERIES_REFRESH_MS = 5000;
let adminKey = sessionStorage.getItem("ember.adminKey") || "";
let timers = [];

function replicaRow(replica) {
  const metrics = replica.metrics;
  const kv = metrics.kv_usage === null ? "–" : (metrics.kv_usage * 100).toFixed(0) + "%";
  return element("tr", { "data-replica": replica.id, "data-state": replica.state },
    element("td", {}, replica.id), element("td", {}, replica.model), element("td", {}, replica.deployment),
    element("td", {}, replica.region || "–"),
    element("td", { class: "state " + replica.state }, replica.state + (replica.ejection_reason ? ` (${replica.ejection_reason})` : "")),
    element("td", {}, `${replica.outstanding} / ${replica.capacity}`),
    element("td", {}, metrics.waiting ?? "–"), element("td", {}, metrics.running ?? "–"), element("td", {}, kv));
}

function modelRow(model) {
  const scaling = model.autoscaling
    ? `${model.autoscaling.current_replicas} (min ${model.autoscaling.min_replicas}, max ${model.autoscaling.max_replicas})`
    : "static";
  return element("tr", { "data-model": model.name },
    element("td", {}, model.name), element("td", {}, model.deployments.join(", ")),
    element("td", {}, `${model.healthy_replicas} / ${model.replicas}`), element("td", {}, scaling));
}

async function refreshFleet() {
  try {
    const fleet = await api("/admin/console/fleet", adminKey);
    $("#models tbody").replaceChildren(...fleet.models.map(modelRow));
    $("#replicas tbody").replaceChildren(...fleet.replicas.map(replicaRow));
    $("#fleet-updated").textContent = "updated " + new Date().toLocaleTimeString();
    showError("#fleet-error");
  } catch (error) {
    showError("#fleet-error", error);
  }
}

async function refreshSeries() {
  try {
    renderCharts($("#charts"), await api("/admin/console/series", adminKey));
  } catch (error) {
    showError("#fleet-error", error);
  }
}

function keyRow(key) {
  const used = key.usage?.total_tokens ?? 0;
  const budgetLeft = key.token_budget === null ? "∞" : Math.max(key.token_budget - used, 0);
  const revoke = key.revoked_at
    ? "revoked"
    : element("button", { type: "button", "data-revoke": key.name, onclick: () => revokeKey(key) }, "Revoke");
  return element("tr", { "data-key": key.name },
    element("td", {}, key.name), element("td", {}, key.display), element("td", {}, (key.models || []).join(", ") || "all"),
    element("td", {}, key.rpm ?? "–"), element("td", {}, key.tpm ?? "–"),
    element("td", {}, key.usage?.requests ?? 0), element("td", {}, used), element("td", {}, budgetLeft),
    element("td", {}, revoke));
}

async function refreshKeys() {
  try {
    const keys = await api("/admin/keys?include_usage=true&include_revoked=true", adminKey);
    $("#keys tbody").replaceChildren(...keys.data.map(keyRow));
    showError("#keys-error");
  } catch (error) {
    showError("#keys-error", error);
  }
}

async function createKey(form) {
  const policy = { name: form.name.value };
  for (const field of ["rpm", "tpm", "token_budget"]) if (form[field].value) policy[field] = Number(form[field].value);
  if (form.models.value) policy.models = form.models.value.split(",").map((m) => m.trim()).filter(Boolean);
  try {
    const created = await api("/admin/keys", adminKey, { method: "POST", body: JSON.stringify(policy) });
    $("#new-key").replaceChildren("New key (shown once, copy it now): ", element("code", { id: "new-key-value" }, created.key));
    form.reset();
    showError("#keys-error");
    await refreshKeys();
  } catch (error) {
    showError("#keys-error", error);
  }
}

async function revokeKey(key) {
  if (!confirm(`Revoke key ${key.name}? Requests with it fail at once.`)) return;
  try {
    await api("/admin/keys/" + encodeURIComponent(key.id), adminKey, { method: "DELETE" });
    await refreshKeys();
  } catch (error) {
    showError("#keys-error", error);
  }
}

async function logIn(key) {
  try {
    await api("/admin/console/fleet", key);
  } catch (error) {
    showError("#login-error", error);
    return;
  }
  adminKey = key;
  sessionStorage.setItem("ember.adminKey", key);
  showError("#login-error");
  $("#login").hidden = true;
  $("#main").hidden = false;
  refreshFleet();
  refreshSeries();
  refreshKeys();
  timers = [setInterval(refreshFleet, FLEET_REFRESH_MS), setInterval(refreshSeries, SERIES_REFRESH_MS)];
}

function logOut() {
  timers.forEach(clearInterval);
  sessionStorage.removeItem("ember.adminKey");
  adminKey = "";
  $("#main").hidden = true;
  $("#login").hidden = false;
}

document.addEventListener("DOMContentLoaded", () => {
  $("#login-form").addEventListener("submit", (event) => { event.preventDefault(); logIn($("#admin-key").value); });
  $("#logout").addEventListener("click", logOut);
  $("#key-form").addEventListener("submit", (event) => { event.preventDefault(); createKey(event.target); });
  setUpPlayground();
  if (adminKey) logIn(adminKey);
});
