// The spot estimate: sends the manifest and the trace to /ui/estimate and draws the
// strategies' cost and time as horizontal bars (a table, so it reads without the bars).
"use strict";
(function () {
  const form = document.getElementById("estimate-form");
  if (!form) return;
  const csrf = document.querySelector('meta[name="csrf-token"]').content;
  const $ = (id) => document.getElementById(id);

  function bar(value, max, text, kind) {
    const td = document.createElement("td");
    const wrap = document.createElement("div");
    wrap.className = "bar-wrap";
    const b = document.createElement("div");
    b.className = "bar " + kind;
    b.style.width = (max > 0 ? (100 * value) / max : 0).toFixed(1) + "%";
    const label = document.createElement("span");
    label.textContent = text;
    wrap.append(b, label);
    td.appendChild(wrap);
    return td;
  }

  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    $("est-error").hidden = true;
    $("est-state").textContent = "Simulating…";
    $("est-run").disabled = true;
    try {
      const resp = await fetch("/ui/estimate", {
        method: "POST",
        headers: { "Content-Type": "application/json", "X-CSRF-Token": csrf },
        body: JSON.stringify({
          manifest: $("est-manifest").value,
          trace: $("est-trace").value,
          mttp: $("est-mttp").value,
          runs: Number($("est-runs").value),
        }),
      });
      const body = await resp.json();
      if (!resp.ok) throw new Error(body.message || resp.statusText);
      const maxCost = Math.max(...body.rows.map((r) => r.cost));
      const maxTime = Math.max(...body.rows.map((r) => r.time_h));
      const rows = body.rows.map((r) => {
        const tr = document.createElement("tr");
        tr.dataset.strategy = r.strategy;
        const name = document.createElement("th");
        name.scope = "row";
        name.textContent = r.strategy;
        tr.append(
          name,
          bar(r.cost, maxCost, "$" + r.cost.toFixed(2), "cost"),
          bar(r.time_h, maxTime, r.time_h.toFixed(2) + " h", "time")
        );
        const vs = document.createElement("td");
        vs.textContent = (100 * r.cost_vs_on_demand).toFixed(0) + " %";
        tr.appendChild(vs);
        return tr;
      });
      $("est-chart").tBodies[0].replaceChildren(...rows);
      $("est-title").textContent =
        body.job + " on " + body.nodes + " nodes, " + body.model + " (" + body.runs + " runs)";
      $("est-result").hidden = false;
      $("est-state").textContent = "Done.";
    } catch (err) {
      $("est-error").textContent = err.message;
      $("est-error").hidden = false;
      $("est-state").textContent = "";
    } finally {
      $("est-run").disabled = false;
    }
  });
})();
