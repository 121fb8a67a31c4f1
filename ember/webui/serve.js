// `ember serve`'s console: the server's status and the playground (console.js).
"use strict";

const STATUS_REFRESH_MS = 2000;

async function refreshStatus() {
  const rows = [];
  const ready = await fetch("/ready");
  rows.push(["Ready", ready.ok ? "yes" : `no (HTTP ${ready.status})`]);
  try {
    const version = await (await fetch("/version")).json();
    rows.push(["Version", version.version]);
  } catch (error) {
    rows.push(["Version", "–"]);
  }
  $("#status tbody").replaceChildren(...rows.map(([name, value]) => element("tr", { "data-status": name }, element("th", {}, name), element("td", {}, value))));
  $("#status-updated").textContent = "updated " + new Date().toLocaleTimeString();
}

document.addEventListener("DOMContentLoaded", () => {
  setUpPlayground();
  const refresh = () => refreshStatus().then(() => showError("#status-error"), (error) => showError("#status-error", error));
  refresh();
  setInterval(refresh, STATUS_REFRESH_MS);
});
