// The gateway console: fleet (with the autoscaler's report), charts, async jobs and batches and keys
// for the admin key, plus the playground (console.js).
"use strict";

const FLEET_REFRESH_MS = 2000;
const SERIES_REFRESH_MS = 5000;
const JOBS_REFRESH_MS = 3000;
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
  const scaling = model.autoscaling;
  const report = scaling?.autoscaler;
  const counts = !scaling ? "static" : report ? `${report.current} → ${report.desired ?? "–"}` : "–";
  const reported = !scaling ? "" : report ? `${report.reported_s_ago} s ago` : "none yet";
  return element("tr", { "data-model": model.name },
    element("td", {}, model.name), element("td", {}, model.deployments.join(", ")),
    element("td", {}, `${model.healthy_replicas} / ${model.replicas}`),
    element("td", { class: "autoscaler", "data-current": report?.current ?? "", "data-desired": report?.desired ?? "" }, counts),
    element("td", {}, scaling ? `${scaling.min_replicas} … ${scaling.max_replicas}` : "–"),
    element("td", {}, reported));
}

function decisionRows(models) {
  const decisions = models.flatMap((model) => model.autoscaling?.autoscaler?.decisions ?? []);
  decisions.sort((a, b) => b.time.localeCompare(a.time));
  return decisions.map((decision) => element("tr", { "data-model": decision.model, "data-reason": decision.reason },
    element("td", {}, new Date(decision.time).toLocaleTimeString()), element("td", {}, decision.model),
    element("td", {}, `${decision.current} → ${decision.desired}`), element("td", {}, decision.reason),
    element("td", {}, decision.detail)));
}

async function refreshFleet() {
  try {
    const fleet = await api("/admin/console/fleet", adminKey);
    $("#models tbody").replaceChildren(...fleet.models.map(modelRow));
    $("#replicas tbody").replaceChildren(...fleet.replicas.map(replicaRow));
    $("#decisions tbody").replaceChildren(...decisionRows(fleet.models));
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

const time = (seconds) => (seconds ? new Date(seconds * 1000).toLocaleTimeString() : "–");

function jobRow(job) {
  const webhook = job.webhook ? job.webhook.status : "–";
  return element("tr", { "data-job": job.id, "data-kind": job.kind, "data-status": job.status, onclick: () => showJob(job.id) },
    element("td", {}, element("a", { href: "#job-detail" }, job.id)), element("td", {}, job.key), element("td", {}, job.model ?? "–"),
    element("td", { class: "state " + job.status }, job.status), element("td", {}, job.priority), element("td", {}, job.attempts),
    element("td", {}, time(job.created_at)), element("td", {}, webhook));
}

async function showJob(id) {
  try {
    const job = await api("/admin/jobs/" + encodeURIComponent(id), adminKey);
    const outcome = job.error ? `error: ${job.error.message}` : job.status_code ? `HTTP ${job.status_code}` : job.status;
    const deliveries = job.webhook
      ? element("table", { id: "webhook-attempts" },
        element("thead", {}, element("tr", {}, ...["Delivery", "At", "Status", "Error"].map((h) => element("th", {}, h)))),
        element("tbody", {}, ...job.webhook.attempts.map((a) => element("tr", { "data-attempt": a.attempt },
          element("td", {}, a.attempt), element("td", {}, time(a.at)), element("td", {}, a.status_code ?? "–"), element("td", {}, a.error ?? "")))))
      : element("p", { class: "muted" }, "No webhook.");
    $("#job-detail").replaceChildren(
      element("h3", { "data-job": job.id }, `Job ${job.id}`),
      element("p", {}, `${job.kind} job of ${job.key} on ${job.model}: ${job.status} after ${job.attempts} attempt(s), ${outcome}. ` +
        `Created ${time(job.created_at)}, started ${time(job.started_at)}, finished ${time(job.finished_at)}.` +
        (job.webhook ? ` Webhook to ${job.webhook.url}: ${job.webhook.status}.` : "")),
      deliveries);
  } catch (error) {
    showError("#jobs-error", error);
  }
}

function batchRow(batch) {
  const counts = batch.request_counts;
  return element("tr", { "data-batch": batch.id, "data-status": batch.status },
    element("td", {}, batch.id), element("td", { class: "state " + batch.status }, batch.status),
    element("td", {}, element("progress", { max: counts.total, value: counts.completed + counts.failed })),
    element("td", {}, counts.completed), element("td", {}, counts.failed), element("td", {}, counts.total),
    element("td", {}, time(batch.created_at)));
}

let jobsRefreshes = 0;

async function refreshJobs() {
  const query = new URLSearchParams({ limit: "50" });
  if ($("#job-status").value) query.set("status", $("#job-status").value);
  if ($("#job-kind").value) query.set("kind", $("#job-kind").value);
  const refresh = ++jobsRefreshes;
  try {
    const [jobs, batches] = await Promise.all([api("/admin/jobs?" + query, adminKey), api("/admin/batches?limit=20", adminKey)]);
    if (refresh !== jobsRefreshes) return; // a later refresh (a changed filter) answers instead
    $("#jobs tbody").replaceChildren(...jobs.data.map(jobRow));
    const counts = Object.entries(jobs.counts_by_status).sort().map(([status, count]) => `${status} ${count}`);
    $("#job-counts").textContent = "All jobs: " + (counts.join(" · ") || "none yet");
    $("#batches tbody").replaceChildren(...batches.data.map(batchRow));
    $("#jobs-updated").textContent = "updated " + new Date().toLocaleTimeString();
    showError("#jobs-error");
  } catch (error) {
    showError("#jobs-error", error);
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
  refreshJobs();
  timers = [setInterval(refreshFleet, FLEET_REFRESH_MS), setInterval(refreshSeries, SERIES_REFRESH_MS),
    setInterval(refreshJobs, JOBS_REFRESH_MS)];
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
  for (const filter of ["#job-status", "#job-kind"]) $(filter).addEventListener("change", refreshJobs);
  setUpPlayground();
  if (adminKey) logIn(adminKey);
});
