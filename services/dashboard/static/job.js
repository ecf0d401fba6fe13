// A job's page: polls its status, streams its logs and metrics (server-sent events), and
// runs the halt/resume/delete buttons after a confirmation.
"use strict";
(function () {
  const root = document.getElementById("job");
  if (!root) return;
  let job = JSON.parse(root.dataset.job);
  const jobId = job.job_id;
  const csrf = document.querySelector('meta[name="csrf-token"]').content;
  const $ = (id) => document.getElementById(id);

  function fmtTime(t) {
    return new Date(t * 1000).toLocaleString();
  }
  for (const el of document.querySelectorAll("time[data-t]")) {
    el.textContent = fmtTime(Number(el.dataset.t));
    el.dateTime = new Date(Number(el.dataset.t) * 1000).toISOString();
  }

  // -- status ------------------------------------------------------------------------------
  function badge(status) {
    const s = document.createElement("span");
    s.className = "status s-" + status;
    s.textContent = status;
    return s;
  }

  function show(view) {
    job = view;
    const st = $("status");
    st.className = "status s-" + view.status;
    st.textContent = view.status;
    $("status-message").textContent = view.status_message;
    $("why-waits").hidden = !view.queue_reason;
    $("why-waits").querySelector("span").textContent = view.queue_reason;
    $("btn-halt").disabled = !view.can_halt;
    $("btn-resume").disabled = !view.can_resume;
    $("btn-delete").disabled = !view.can_delete;
    if ($("btn-scale")) $("btn-scale").disabled = !view.can_scale;
    const items = view.history.map((h) => {
      const li = document.createElement("li");
      const t = document.createElement("time");
      t.textContent = fmtTime(h.time);
      t.dateTime = new Date(h.time * 1000).toISOString();
      li.append(t, " ", badge(h.status), " " + h.message);
      return li;
    });
    $("history").replaceChildren(...items);
    function tableRow(values) {
      const tr = document.createElement("tr");
      for (const v of values) {
        const td = document.createElement("td");
        td.textContent = String(v);
        tr.appendChild(td);
      }
      return tr;
    }
    const rows = view.placement.map((p) => tableRow([p.learner, p.node, p.zone]));
    if (rows.length) $("placement").tBodies[0].replaceChildren(...rows);
    const stages = (view.stages || []).map((r) =>
      tableRow([r.learner, r.stage, r.pipeline, r.zone, r.why])
    );
    $("stages-box").hidden = !stages.length;
    if (stages.length) $("stages").tBodies[0].replaceChildren(...stages);
    const saves = (view.checkpoints || []).map((c) => {
      const tr = tableRow(["", c.kind, c.step, fmtBytes(c.size_bytes), c.learner]);
      tr.dataset.kind = c.kind;
      const t = document.createElement("time");
      t.textContent = fmtTime(c.time);
      t.dateTime = new Date(c.time * 1000).toISOString();
      tr.cells[0].replaceChildren(t);
      return tr;
    });
    if (saves.length) $("checkpoints").tBodies[0].replaceChildren(...saves);
    showCost(view.cost);
    if (view.final) $("cost-to-finish").textContent = "the job has ended";
  }

  // Cents, and tenths of a cent under a dollar: a short job's cost is not "$0.00".
  function dollars(d) {
    return "$" + d.toFixed(d < 1 ? 4 : 2);
  }

  function showCost(cost) {
    if (!cost) {
      $("cost-so-far").textContent = "unknown: the scheduler did not answer";
      return;
    }
    $("cost-so-far").textContent =
      dollars(cost.dollars) + " (" + cost.node_hours.toFixed(2) + " node-hours)";
    $("cost-unpriced").hidden = !cost.unpriced.length;
    $("cost-unpriced").querySelector("span").textContent = cost.unpriced.join(", ");
  }

  // The simulator's estimate to finish: recomputed by the server when the job reports a
  // new step, so a slow poll is enough.
  async function estimate() {
    if (job.final) {
      $("cost-to-finish").textContent = "the job has ended";
      return;
    }
    try {
      const resp = await fetch("/ui/jobs/" + encodeURIComponent(jobId) + "/estimate");
      const body = await resp.json();
      if (!resp.ok) throw new Error(body.message || resp.statusText);
      if (job.final) return; // it ended while the estimate was asked for
      $("cost-to-finish").textContent = body.problem
        ? body.problem
        : body.steps_done >= body.steps_total
        ? "no steps left: " + body.steps_done + " of " + body.steps_total + " done"
        : dollars(body.dollars) + " and " + (body.hours * 60).toFixed(1) +
          " min for steps " + body.steps_done + "–" + body.steps_total + " (" + body.strategy +
          " checkpointing, preemptions as in " + body.model + ")";
    } catch (err) {
      $("cost-to-finish").textContent = "no estimate now (" + err.message + "); retrying";
    }
  }
  estimate();
  setInterval(estimate, 10000);

  // Jinja's filesizeformat, so the first render and the live updates read alike.
  function fmtBytes(n) {
    const units = ["Bytes", "kB", "MB", "GB", "TB"];
    if (n < 1000) return n + (n === 1 ? " Byte" : " Bytes");
    let i = 0;
    let v = n;
    while (v >= 1000 && i < units.length - 1) {
      v /= 1000;
      i += 1;
    }
    return v.toFixed(1) + " " + units[i];
  }

  let statusFailing = false;
  async function poll() {
    try {
      const resp = await fetch("/ui/jobs/" + encodeURIComponent(jobId));
      if (resp.status === 401) {
        window.location.href = "/login?why=expired&next=" + encodeURIComponent(location.pathname);
        return;
      }
      const body = await resp.json();
      if (!resp.ok) throw new Error(body.message || resp.statusText);
      const wasFinal = job.final;
      show(body);
      if (!body.final && wasFinal) startStreams();
      if (statusFailing) $("outcome").textContent = "Reconnected.";
      statusFailing = false;
    } catch (err) {
      statusFailing = true;
      $("outcome").textContent = "Lost contact with the server (" + err.message + "); retrying…";
    }
  }
  setInterval(poll, 2000);

  // -- actions -----------------------------------------------------------------------------
  const dialog = $("confirm");
  const explain = {
    halt: "Halt this job? Its learners stop; you can resume it later.",
    resume: "Resume this job? It is queued again and restarts from its last checkpoint.",
    delete: "Delete this job? Its learners stop and it cannot be resumed.",
  };
  let pending = null;
  for (const b of document.querySelectorAll("button[data-action]")) {
    b.addEventListener("click", () => {
      pending = b.dataset.action;
      $("confirm-title").textContent = b.textContent + " " + job.name + "?";
      $("confirm-text").textContent = pending === "scale"
        ? "Scale this job to " + $("scale-learners").value + " learner(s)? It keeps training while it scales."
        : explain[pending];
      $("confirm-ok").textContent = b.textContent;
      // Escape closes the dialog without setting a value: clear the last answer first.
      dialog.returnValue = "";
      dialog.showModal();
      $("confirm-cancel").focus();
    });
  }
  dialog.addEventListener("close", async () => {
    const action = pending;
    pending = null;
    if (dialog.returnValue !== "ok" || !action) return;
    $("outcome").textContent = action + " requested…";
    try {
      const extra = action === "scale"
        ? "?learners=" + encodeURIComponent($("scale-learners").value) : "";
      const resp = await fetch("/ui/jobs/" + encodeURIComponent(jobId) + "/" + action + extra, {
        method: "POST",
        headers: { "X-CSRF-Token": csrf },
      });
      const body = await resp.json();
      if (!resp.ok) {
        $("outcome").textContent = action + " refused: " + body.message;
        return;
      }
      show(body);
      $("outcome").textContent = action + " done: the job is " + body.status + ".";
      if (action === "resume") startStreams();
    } catch (err) {
      $("outcome").textContent = action + " failed: " + err.message;
    }
  });

  // -- logs --------------------------------------------------------------------------------
  const logs = $("logs");
  const MAX_LINES = 5000;
  let logSource = null;

  function openLogs() {
    if (logSource) logSource.close();
    logs.replaceChildren();
    const learner = $("log-learner").value;
    const search = $("log-search").value;
    const params = new URLSearchParams({ learner, search });
    const src = new EventSource("/ui/jobs/" + encodeURIComponent(jobId) + "/logs?" + params);
    logSource = src;
    $("log-state").textContent = search ? "Searching…" : "Following…";
    src.onmessage = (ev) => {
      const l = JSON.parse(ev.data);
      const line = document.createElement("div");
      line.className = "line s-" + l.stream;
      line.textContent = "[" + (l.learner || 0) + "/" + l.stream + "] " + l.line;
      logs.appendChild(line);
      while (logs.childElementCount > MAX_LINES) logs.firstElementChild.remove();
      if ($("log-follow").checked) logs.scrollTop = logs.scrollHeight;
      if ($("log-state").dataset.lost) {
        delete $("log-state").dataset.lost;
        $("log-state").textContent = "Reconnected; following again.";
      }
    };
    src.addEventListener("end", () => {
      src.close();
      $("log-state").textContent = search
        ? logs.childElementCount + " matching line(s)."
        : "The job has ended; these are all of its lines.";
    });
    src.addEventListener("problem", (ev) => {
      $("log-state").textContent = JSON.parse(ev.data).message + "; reconnecting…";
    });
    src.onerror = () => {
      if (src.readyState === EventSource.CLOSED) return;
      $("log-state").dataset.lost = "1";
      $("log-state").textContent = "The log stream dropped; reconnecting…";
    };
  }
  $("log-controls").addEventListener("submit", (ev) => {
    ev.preventDefault();
    openLogs();
  });

  // -- metrics -----------------------------------------------------------------------------
  const plots = new Map(); // metric name -> {uplot, series: Map(learner -> Map(step -> value))}
  let metricSource = null;
  let redraw = null;

  function chartFor(name) {
    let p = plots.get(name);
    if (p) return p;
    $("no-metrics").hidden = true;
    const box = document.createElement("figure");
    box.className = "plot";
    box.dataset.metric = name;
    const cap = document.createElement("figcaption");
    cap.textContent = name;
    box.appendChild(cap);
    $("plots").appendChild(box);
    p = { name, box, series: new Map(), uplot: null };
    plots.set(name, p);
    return p;
  }

  function width() {
    return Math.max(260, Math.min(560, $("plots").clientWidth - 16));
  }

  function draw() {
    redraw = null;
    for (const p of plots.values()) {
      const learners = [...p.series.keys()].sort((a, b) => a - b);
      const steps = [...new Set(learners.flatMap((l) => [...p.series.get(l).keys()]))].sort(
        (a, b) => a - b
      );
      const data = [steps, ...learners.map((l) => steps.map((s) => p.series.get(l).get(s) ?? null))];
      if (!p.uplot || p.uplot.series.length !== learners.length + 1) {
        if (p.uplot) p.uplot.destroy();
        const colors = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2"];
        p.uplot = new uPlot(
          {
            width: width(),
            height: 220,
            scales: { x: { time: false } },
            axes: [{ label: "step" }, {}],
            series: [
              { label: "step" },
              ...learners.map((l, i) => ({
                label: "learner " + l,
                stroke: colors[i % colors.length],
                width: 2,
                points: { show: steps.length < 60 },
              })),
            ],
          },
          data,
          p.box
        );
      } else {
        p.uplot.setData(data);
      }
      p.box.dataset.points = String(steps.length);
    }
  }

  function openMetrics() {
    if (metricSource) metricSource.close();
    const src = new EventSource("/ui/jobs/" + encodeURIComponent(jobId) + "/metrics");
    metricSource = src;
    src.onmessage = (ev) => {
      const m = JSON.parse(ev.data);
      const p = chartFor(m.name);
      const learner = m.learner || 0;
      if (!p.series.has(learner)) p.series.set(learner, new Map());
      p.series.get(learner).set(Number(m.step || 0), m.value);
      // Many samples arrive at once when the page opens: draw once per frame, not per sample.
      if (!redraw) redraw = requestAnimationFrame(draw);
    };
    src.addEventListener("end", () => src.close());
  }

  function startStreams() {
    openLogs();
    openMetrics();
  }
  window.addEventListener("resize", () => {
    for (const p of plots.values()) if (p.uplot) p.uplot.setSize({ width: width(), height: 220 });
  });
  startStreams();
})();
