// The jobs list: re-reads the shown page every few seconds and updates the rows in place.
"use strict";
(function () {
  const table = document.getElementById("jobs");
  const live = document.getElementById("live");
  if (!table) return;
  const admin = table.dataset.admin === "true";
  const query = table.dataset.query;
  let failing = false;

  function cell(text) {
    const td = document.createElement("td");
    td.textContent = text;
    return td;
  }

  function row(job) {
    const tr = document.createElement("tr");
    tr.dataset.job = job.job_id;
    const id = document.createElement("td");
    const a = document.createElement("a");
    a.href = "/jobs/" + encodeURIComponent(job.job_id);
    a.textContent = job.job_id;
    id.appendChild(a);
    tr.appendChild(id);
    tr.appendChild(cell(job.name));
    if (admin) tr.appendChild(cell(job.owner));
    const st = document.createElement("td");
    const badge = document.createElement("span");
    badge.className = "status s-" + job.status;
    badge.textContent = job.status;
    st.appendChild(badge);
    tr.appendChild(st);
    tr.appendChild(cell(job.phase));
    tr.appendChild(cell(String(job.learners)));
    tr.appendChild(cell(String(Math.round(job.gpus * 100) / 100)));
    const metric = cell(job.last_metric);
    metric.className = "metric";
    tr.appendChild(metric);
    return tr;
  }

  async function refresh() {
    try {
      const resp = await fetch("/ui/jobs?" + query, { credentials: "same-origin" });
      if (resp.status === 401) {
        window.location.href = "/login?why=expired&next=/";
        return;
      }
      const body = await resp.json();
      if (!resp.ok) throw new Error(body.message || resp.statusText);
      const tbody = table.tBodies[0];
      const focused = document.activeElement && tbody.contains(document.activeElement)
        ? document.activeElement.textContent : null;
      tbody.replaceChildren(...body.jobs.map(row));
      const total = document.getElementById("total");
      if (total) {
        const filtered = /(status|name)=[^&]/.test(query);
        total.textContent = body.total + (body.total === 1 ? " job" : " jobs") +
          (filtered ? " match this filter" : "");
      }
      if (!body.jobs.length) {
        const tr = document.createElement("tr");
        const td = cell("No jobs.");
        td.colSpan = 8;
        tr.appendChild(td);
        tbody.appendChild(tr);
      }
      if (focused) {
        // Keep keyboard focus on the same job's link after the rows are replaced.
        for (const a of tbody.querySelectorAll("a")) if (a.textContent === focused) a.focus();
      }
      if (failing) live.textContent = "Reconnected; the list is live again.";
      failing = false;
    } catch (err) {
      failing = true;
      live.textContent = "Lost contact with the server (" + err.message + "); retrying…";
    }
  }
  setInterval(refresh, 3000);
})();
