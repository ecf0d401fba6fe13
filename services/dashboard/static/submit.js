// The submit form: loads an example's or a file's manifest into the editor and checks it
// against the schema as it is typed, showing the problem beside the field.
"use strict";
(function () {
  const form = document.getElementById("submit-form");
  if (!form) return;
  const csrf = document.querySelector('meta[name="csrf-token"]').content;
  const text = document.getElementById("manifest");
  const error = document.getElementById("manifest-error");
  const ok = document.getElementById("manifest-ok");
  let timer = null;

  async function check() {
    timer = null;
    try {
      const resp = await fetch("/ui/validate", {
        method: "POST",
        headers: { "Content-Type": "application/json", "X-CSRF-Token": csrf },
        body: JSON.stringify({ manifest: text.value }),
      });
      const body = await resp.json();
      if (!resp.ok) throw new Error(body.message || resp.statusText);
      if (body.valid) {
        error.hidden = true;
        ok.hidden = false;
        text.removeAttribute("aria-invalid");
      } else {
        error.textContent = body.field
          ? "Field " + body.field + ": " + body.problem
          : body.problem;
        error.hidden = false;
        ok.hidden = true;
        text.setAttribute("aria-invalid", "true");
      }
    } catch (err) {
      error.textContent = "Could not check the manifest: " + err.message;
      error.hidden = false;
    }
  }
  function later() {
    if (timer) clearTimeout(timer);
    timer = setTimeout(check, 300);
  }
  text.addEventListener("input", later);

  document.getElementById("example").addEventListener("change", async (ev) => {
    const name = ev.target.value;
    if (!name) return;
    const resp = await fetch("/ui/examples/" + encodeURIComponent(name));
    const body = await resp.json();
    if (resp.ok) {
      text.value = body.manifest;
      check();
    } else {
      error.textContent = body.message;
      error.hidden = false;
    }
  });
  document.getElementById("manifest-file").addEventListener("change", async (ev) => {
    const file = ev.target.files[0];
    if (!file) return;
    text.value = await file.text();
    check();
  });
  if (text.value) check();
})();
