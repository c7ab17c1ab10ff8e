// nightshift's web UI: the little script. Live parts of a page (elements with `data-live`
// and an id) are fetched again from the same URL every two seconds and swapped in; a log
// panel (`#log` with `data-src`) follows its job's output as server-sent events.
"use strict";
(function () {
  const LIVE_MS = 2000;

  async function refresh() {
    const live = document.querySelectorAll("[data-live][id]");
    if (live.length === 0 || document.hidden) return;
    let r;
    try {
      r = await fetch(location.href, { headers: { "X-Nightshift-Live": "1" }, credentials: "same-origin" });
    } catch (e) {
      return;
    }
    if (r.status === 401) { location.href = "/ui/login"; return; }
    if (!r.ok) return;
    const doc = new DOMParser().parseFromString(await r.text(), "text/html");
    for (const el of live) {
      const fresh = doc.getElementById(el.id);
      if (fresh && fresh.innerHTML !== el.innerHTML) el.replaceWith(fresh);
    }
  }
  setInterval(refresh, LIVE_MS);

  function follow(log) {
    const status = document.getElementById("log-status");
    const say = (text, cls) => { if (status) { status.textContent = text; status.className = "log-status " + (cls || ""); } };
    const events = new EventSource(log.dataset.src);
    events.onopen = () => say("following", "on");
    events.onmessage = (e) => {
      const atEnd = log.scrollTop + log.clientHeight >= log.scrollHeight - 8;
      const line = document.createElement("span");
      line.className = "line";
      line.textContent = e.data + "\n";
      log.appendChild(line);
      if (atEnd) log.scrollTop = log.scrollHeight;
    };
    events.addEventListener("wait", (e) => say(e.data, "wait"));
    events.addEventListener("end", (e) => { say(e.data || "ended", "end"); events.close(); });
    events.onerror = () => { if (events.readyState === EventSource.CLOSED) say("disconnected", "end"); };
  }
  const log = document.getElementById("log");
  if (log && log.dataset.src) follow(log);
})();
