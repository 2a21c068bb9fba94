// mortalctl dashboard: refresh the page's sections every few seconds from the JSON endpoint the page names
// (data-api, asked with sections=1: the server renders and escapes every section; the script parses
// them in an inert document and moves the nodes in). No other script runs.
(function () {
  "use strict";
  const body = document.body;
  const api = body.dataset.api;
  const seconds = parseFloat(body.dataset.refresh || "0");
  const live = document.getElementById("live");
  const shown = new Map();  // each section's last fragment: an unchanged one is left alone
  function autosubmit() {
    document.querySelectorAll("select[data-autosubmit]").forEach(function (select) {
      select.addEventListener("change", function () {
        const params = new URLSearchParams(location.search);
        if (select.value) { params.set("step", select.value); } else { params.delete("step"); }
        location.search = params.toString();
      });
    });
  }
  async function refresh() {
    if (document.hidden) { return; }
    try {
      const sep = api.includes("?") ? "&" : "?";
      const response = await fetch(api + sep + "sections=1", {headers: {"Accept": "application/json"}});
      if (!response.ok) { throw new Error("HTTP " + response.status); }
      const doc = await response.json();
      for (const [id, fragment] of Object.entries(doc.sections || {})) {
        const element = document.getElementById(id);
        if (element && shown.get(id) !== fragment) {
          // parsed in an inert document, then moved in: store text arrives as text nodes, never as markup
          const parsed = new DOMParser().parseFromString(fragment, "text/html");
          element.replaceChildren(...parsed.body.childNodes);
          shown.set(id, fragment);
        }
      }
      autosubmit();
      live.textContent = "live · " + new Date().toLocaleTimeString();
      live.className = "live";
    } catch (err) {
      live.textContent = "store unreachable (" + err.message + "), retrying";
      live.className = "live stale";
    }
  }
  autosubmit();
  if (api && seconds > 0) {
    setInterval(refresh, seconds * 1000);
    document.addEventListener("visibilitychange", refresh);
  } else if (live) {
    live.textContent = "";
  }
})();
