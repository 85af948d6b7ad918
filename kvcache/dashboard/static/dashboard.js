// kvcache status page: fetches api/cluster every refresh_ms and redraws.
// Data only ever reaches the DOM as text (textContent), never as markup.
"use strict";

(function () {
  const VIEW_VERSION = 1;
  const $ = (id) => document.getElementById(id);
  let refreshMs = 2000;
  let rendered = false;

  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }

  function bytes(n) {
    if (n === null || n === undefined) return "—";
    const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let v = Number(n);
    let i = 0;
    while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
    return (i === 0 ? v.toFixed(0) : v.toFixed(v >= 100 ? 0 : v >= 10 ? 1 : 2)) + " " + units[i];
  }

  function num(n, digits) {
    if (n === null || n === undefined || Number.isNaN(n)) return "—";
    return Number(n).toLocaleString("en-US", { maximumFractionDigits: digits === undefined ? 1 : digits });
  }

  function pct(x) {
    return x === null || x === undefined ? "—" : (100 * x).toFixed(1) + " %";
  }

  function ms(x) {
    if (x === null || x === undefined) return "—";
    if (x >= 1000) return (x / 1000).toFixed(x >= 10000 ? 0 : 1) + " s";
    return x < 1 ? x.toFixed(2) + " ms" : x < 100 ? x.toFixed(1) + " ms" : x.toFixed(0) + " ms";
  }

  function ago(seconds) {
    if (seconds === null || seconds === undefined) return "never";
    if (seconds < 1) return "just now";
    if (seconds < 90) return seconds.toFixed(0) + " s ago";
    if (seconds < 5400) return (seconds / 60).toFixed(0) + " min ago";
    return (seconds / 3600).toFixed(1) + " h ago";
  }

  function clock(t) {
    return new Date(t * 1000).toLocaleTimeString("en-GB", { hour12: false });
  }

  // cells: strings, or {text, cls} objects, or DOM nodes.
  function fill(tbody, rows) {
    const frag = document.createDocumentFragment();
    for (const row of rows) {
      const tr = el("tr");
      if (row.attrs) for (const [k, v] of Object.entries(row.attrs)) tr.setAttribute(k, v);
      if (row.cls) tr.className = row.cls;
      for (const cell of row.cells) {
        if (cell instanceof Node) {
          const td = el("td");
          td.appendChild(cell);
          tr.appendChild(td);
        } else if (cell !== null && typeof cell === "object") {
          const td = el("td", cell.text, cell.cls);
          if (cell.node) td.appendChild(cell.node);
          if (cell.title) td.title = cell.title;
          tr.appendChild(td);
        } else {
          tr.appendChild(el("td", cell));
        }
      }
      frag.appendChild(tr);
    }
    tbody.replaceChildren(frag);
  }

  function banner(text, kind) {
    const b = $("banner");
    if (!text) { b.hidden = true; b.textContent = ""; return; }
    b.hidden = false;
    b.className = "banner" + (kind ? " " + kind : "");
    b.textContent = text;
  }

  function renderHeader(v) {
    const t = v.totals;
    const pill = $("summary-health");
    pill.textContent = t.healthy + " / " + t.nodes + " nodes healthy";
    pill.className = "pill " + (t.healthy === t.nodes ? "ok" : t.healthy * 2 > t.nodes ? "warn" : "bad");
    pill.dataset.healthy = String(t.healthy);
    pill.dataset.nodes = String(t.nodes);
    $("served-by").textContent = "served by " + v.served_by;
    $("updated").textContent = "updated " + clock(v.generated_at);
    $("logout").hidden = v.auth !== "token";
    const c = v.cluster;
    let source = "Cluster map: " + c.source + (c.epoch === null ? "" : " (epoch " + c.epoch + ")");
    if (c.error) source += " — cannot read it: " + c.error;
    $("cluster-source").textContent = source;
    if (v.auth === "open") banner("No admin token is configured: this page is open to anyone who can reach it.", "info");
    else banner("");
  }

  function watermarkCell(w) {
    const wrap = el("span");
    const bar = el("span", null, "bar " + w.state);
    const inner = el("span");
    inner.style.width = Math.min(100, 100 * w.fill).toFixed(1) + "%";
    bar.appendChild(inner);
    wrap.appendChild(bar);
    const label = w.state === "ok" ? "below low" : w.state === "between" ? "between marks" : "above high: evicting";
    wrap.appendChild(el("span", label, "wm-" + w.state));
    wrap.title = "fill " + pct(w.fill) + ", low " + pct(w.low) + ", high " + pct(w.high);
    return wrap;
  }

  function renderNodes(v) {
    const rows = v.nodes.map((n) => ({
      attrs: { "data-node": n.id, "data-health": n.health, "data-state": n.state },
      cls: n.health,
      cells: [
        n.id,
        { node: el("span", n.health, "badge " + n.health), title: n.error || "answered /stats" },
        { node: el("span", n.state, "badge " + (n.state === "up" ? "healthy" : "out")) },
        n.domain,
        { text: ago(n.age_s), title: n.last_seen ? new Date(n.last_seen * 1000).toISOString() : "never seen by this page" },
        n.health === "healthy" ? bytes(n.used_bytes) + " / " + bytes(n.capacity_bytes) : { text: n.error, cls: "note" },
        n.health === "healthy" ? watermarkCell(n.watermark) : "",
        { text: n.health === "healthy" ? num(n.shards, 0) : "", cls: "num" },
        { text: num(n.requests_per_s), cls: "num" },
        { text: n.health === "healthy" ? ms(n.poll_ms) : "", cls: "num" },
      ],
    }));
    fill($("nodes").tBodies[0], rows);
  }

  function renderCapacity(v) {
    const t = v.totals;
    const fillRatio = t.capacity_bytes ? t.used_bytes / t.capacity_bytes : 0;
    $("capacity-total").textContent = bytes(t.used_bytes) + " of " + bytes(t.capacity_bytes) +
      " used (" + pct(fillRatio) + ") in " + num(t.shards, 0) + " shards, on the " + t.healthy + " nodes that answered";
    const classes = Object.entries(t.classes);
    fill($("classes").tBodies[0], classes.map(([name, c]) => ({
      attrs: { "data-class": name },
      cells: [name, { text: bytes(c.bytes), cls: "num" }, { text: num(c.shards, 0), cls: "num" },
        { text: pct(t.used_bytes ? c.bytes / t.used_bytes : null), cls: "num" }],
    })));
    fill($("tenants").tBodies[0], Object.entries(t.tenants).map(([name, e]) => ({
      attrs: { "data-tenant": name },
      cells: [name, { text: bytes(e.bytes), cls: "num" }, { text: num(e.shards, 0), cls: "num" },
        Object.entries(e.classes).map(([c, b]) => c + " " + bytes(b)).join(", ")],
    })));
  }

  function renderHits(v) {
    const r = v.rates;
    $("hits-window").textContent = "Daemon-side: GET shards served (hits) and not found (misses), " +
      v.window.label + ". A prompt's block hit rate is the clients' (match_prefix): blocks known missing are never asked for." +
      (r.per_class_misses ? "" : " These daemons count misses for all classes together, so the hit ratio is cluster-wide only.");
    const rows = Object.entries(r.classes).map(([name, c]) => ({
      attrs: { "data-class": name },
      cells: [name, { text: num(c.hits_per_s), cls: "num" }, { text: num(c.misses_per_s), cls: "num" },
        { text: pct(c.hit_ratio), cls: "num" }, { text: pct(c.total_hit_ratio), cls: "num" }],
    }));
    rows.push({
      attrs: { "data-class": "*" },
      cls: "total",
      cells: ["all classes", { text: num(r.all.hits_per_s), cls: "num" }, { text: num(r.all.misses_per_s), cls: "num" },
        { text: pct(r.all.hit_ratio), cls: "num" }, { text: pct(r.all.total_hit_ratio), cls: "num" }],
    });
    fill($("hit-rates").tBodies[0], rows);
    renderChart(v.series);
  }

  function renderChart(s) {
    const svg = $("hit-chart");
    const NS = "http://www.w3.org/2000/svg";
    const W = 600, H = 160, PAD = 4;
    const nodes = [];
    for (const y of [0, 0.5, 1]) {
      const line = document.createElementNS(NS, "line");
      const py = PAD + (1 - y) * (H - 2 * PAD);
      line.setAttribute("x1", "0"); line.setAttribute("x2", String(W));
      line.setAttribute("y1", String(py)); line.setAttribute("y2", String(py));
      line.setAttribute("class", "grid");
      nodes.push(line);
      const label = document.createElementNS(NS, "text");
      label.setAttribute("x", "2"); label.setAttribute("y", String(Math.max(10, py - 2)));
      label.textContent = (100 * y).toFixed(0) + "%";
      nodes.push(label);
    }
    const legend = [];
    const series = [["all classes", s.hit_ratio, "call"]];
    Object.entries(s.class_hit_ratio).forEach(([name, ys], i) => series.push([name, ys, "c" + (i % 6)]));
    const t = s.t;
    if (t.length >= 1) {
      const t0 = t[0], t1 = t[t.length - 1];
      const x = (ti) => (t1 === t0 ? W / 2 : ((ti - t0) / (t1 - t0)) * (W - 2 * PAD) + PAD);
      for (const [name, ys, cls] of series) {
        let points = [];
        const flush = () => {
          if (points.length === 1) {
            // A lone interval: a dot, since a one-point line draws nothing.
            const [cx, cy] = points[0].split(",");
            const dot = document.createElementNS(NS, "circle");
            dot.setAttribute("cx", cx); dot.setAttribute("cy", cy); dot.setAttribute("r", "3");
            dot.setAttribute("class", "series " + cls);
            dot.dataset.series = name;
            nodes.push(dot);
          } else if (points.length) {
            const pl = document.createElementNS(NS, "polyline");
            pl.setAttribute("points", points.join(" "));
            pl.setAttribute("class", "series " + cls);
            pl.dataset.series = name;
            nodes.push(pl);
          }
          points = [];
        };
        ys.forEach((y, i) => {
          if (y === null) { flush(); return; }
          points.push(x(t[i]).toFixed(1) + "," + (PAD + (1 - y) * (H - 2 * PAD)).toFixed(1));
        });
        flush();
        if (ys.some((y) => y !== null)) legend.push(el("span", name, cls));
      }
    }
    svg.replaceChildren(...nodes);
    $("hit-legend").replaceChildren(...legend);
    $("hit-history").textContent = t.length
      ? "From " + clock(t[0]) + " to " + clock(t[t.length - 1]) + ": kept while this page is open, sampled every 10 s or less, for 10 min."
      : "The chart fills while this page is open (one point every 10 s).";
  }

  function renderLatency(v) {
    const b = v.latency.bounds_ms;
    $("latency-what").textContent = "Daemon-side " + v.latency.what + ". Percentiles interpolated in histogram buckets (" +
      b.length + " bounds, " + ms(b[0]) + " to " + ms(b[b.length - 1]) + "); a client also waits for the network and its own work.";
    const rows = [];
    for (const [op, row] of Object.entries(v.latency.ops)) {
      for (const [name, q] of [[v.window.label, row.window], ["since start", row.total]]) {
        rows.push({
          attrs: { "data-op": op, "data-window": name === "since start" ? "total" : "window" },
          cells: [name === "since start" ? "" : row.label, name, { text: num(q.count, 0), cls: "num" },
            { text: ms(q.p50_ms), cls: "num" }, { text: ms(q.p90_ms), cls: "num" },
            { text: ms(q.p99_ms), cls: "num" }, { text: ms(q.mean_ms), cls: "num" }],
        });
      }
    }
    fill($("latencies").tBodies[0], rows);
  }

  function renderErrors(v) {
    fill($("error-kinds").tBodies[0], v.errors.map((e) => ({
      attrs: { "data-kind": e.kind },
      cells: [e.kind, { text: num(e.window, 0), cls: "num" }, { text: num(e.total, 0), cls: "num" }],
    })));
    $("errors-none").hidden = v.errors.length > 0;
  }

  function renderGc(v) {
    fill($("gc-counters").tBodies[0], Object.entries(v.gc).map(([name, g]) => ({
      attrs: { "data-counter": name },
      cells: [name.replace(/_/g, " "),
        { text: name.endsWith("bytes") ? bytes(g.per_s) + "/s" : num(g.per_s), cls: "num" },
        { text: name.endsWith("bytes") ? bytes(g.total) : num(g.total, 0), cls: "num" }],
    })));
  }

  function age(seconds) {
    if (seconds === null || seconds === undefined) return "—";
    if (seconds >= 86400) return (seconds / 86400).toFixed(1) + " d";
    if (seconds >= 3600) return (seconds / 3600).toFixed(1) + " h";
    if (seconds >= 60) return (seconds / 60).toFixed(1) + " min";
    return seconds.toFixed(0) + " s";
  }

  function renderRetention(v) {
    const r = v.retention;
    if (!r) return;
    $("retention-text").textContent = r.text;
    fill($("retention-classes").tBodies[0], r.rows.map((row) => ({
      attrs: { "data-tenant": row.tenant, "data-class": row["class"] },
      cls: row.evicted ? "bad" : "",
      cells: [row.tenant, row["class"], { text: num(row.expired, 0), cls: "num" },
        { text: num(row.evicted, 0), cls: "num" }, { text: num(row.quota, 0), cls: "num" },
        { text: num(row.deleted, 0), cls: "num" }, { text: age(row.oldest_live_age_s), cls: "num" }],
    })));
  }

  function render(v) {
    if (v.version !== VIEW_VERSION) {
      banner("This page (view version " + VIEW_VERSION + ") does not match the server's data (version " + v.version + "): reload it.");
      return;
    }
    refreshMs = v.refresh_ms || refreshMs;
    renderHeader(v);
    renderNodes(v);
    renderCapacity(v);
    renderHits(v);
    renderLatency(v);
    renderErrors(v);
    renderGc(v);
    renderRetention(v);
    $("repair-text").textContent = v.repair.text;
    fill($("scrub-nodes").tBodies[0], (v.repair.nodes || []).map((n) => ({
      attrs: { "data-node": n.node },
      cells: [n.node, n.enabled ? (n.running ? "running" : "idle") : "off",
        { text: (100 * n.progress).toFixed(0) + " %", cls: "num" },
        { text: num(n.passes, 0), cls: "num" },
        { text: num(n.checked, 0), cls: "num" },
        { text: num(n.bad, 0), cls: "num" }],
    })));
    document.body.dataset.generatedAt = String(v.generated_at);
    if (!rendered) {
      rendered = true;
      document.body.dataset.loaded = "1";
      if (window.performance && performance.mark) performance.mark("kvcache-first-render");
    }
  }

  async function refresh() {
    try {
      const resp = await fetch("api/cluster", { credentials: "same-origin", cache: "no-store" });
      if (resp.status === 401) {
        banner("Your session has ended (the admin token changed?): reload the page to log in again.");
      } else if (!resp.ok) {
        banner("The server answered HTTP " + resp.status + ".");
      } else {
        render(await resp.json());
      }
    } catch (err) {
      banner("Lost contact with " + location.host + " (" + err + "); retrying every " + refreshMs / 1000 + " s.");
      $("summary-health").className = "pill bad";
    } finally {
      window.setTimeout(refresh, refreshMs);
    }
  }

  refresh();
})();
