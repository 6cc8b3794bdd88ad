/* memplan's interactive memory timeline: vanilla JavaScript on <canvas>, no network.
 *
 * Each `<div class="mp-timeline" data-src="ID">` is drawn from the JSON in
 * `<script type="application/json" id="ID">` (written by memplan/report/timeline.py).
 * Three panels share one time axis (allocator events of the step):
 *  - live memory: every drawn tensor is a block stacked in allocation order, the blocks
 *    above a freed one move down (the layout of PyTorch's memory_viz, MemoryViz.js
 *    "Active Memory Timeline"); the tensors too small to draw one by one are summed per
 *    category on top; other steps of the job (measured or estimated) are dashed lines;
 *  - the caching allocator: each block at its address, inside its segments (cudaMalloc
 *    to cudaFree);
 *  - the plan's arena: each block at its planned offset.
 * Mouse wheel zooms the time axis around the cursor, dragging pans, a double click
 * resets; hovering a block shows its name, category, module, op, size and lifetime.
 * The script may be included once per timeline: it draws each timeline once.
 */
(function () {
  "use strict";
  if (window.memplanTimeline) {
    window.memplanTimeline.drawAll();
    return;
  }
  /* Category and phase colours come with the data (memplan/report/colors.py), the same as the PNG figures' */
  var OVERLAY = ["#111111", "#8c564b", "#17becf", "#7f7f7f"];
  var LEFT = 64, TOP = 20, BOTTOM = 22, RIGHT = 8;

  function fmtBytes(b) {
    var units = ["B", "KiB", "MiB", "GiB", "TiB"], i = 0, v = Math.abs(b);
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
    return (b < 0 ? "-" : "") + (i === 0 ? v.toFixed(0) : v.toFixed(v < 10 ? 2 : 1)) + " " + units[i];
  }

  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) { e.className = cls; }
    if (text !== undefined) { e.textContent = text; }
    return e;
  }

  /* Per block: [[event, offset], ...] — where it sits in the stack from each event on. */
  function stackBlocks(B) {
    var n = B.id.length, ev = [], i;
    for (i = 0; i < n; i += 1) {
      ev.push([B.alloc[i], 1, i]);
      ev.push([B.free[i], 0, i]);
    }
    ev.sort(function (a, b) { return a[0] - b[0] || a[1] - b[1]; });
    var stack = [], offset = new Array(n), pts = new Array(n), height = 0;
    ev.forEach(function (e) {
      var t = e[0], b = e[2], j;
      if (e[1] === 1) {
        offset[b] = height;
        pts[b] = [[t, height]];
        height += B.nbytes[b];
        stack.push(b);
        return;
      }
      var at = stack.indexOf(b);
      if (at < 0) { return; }
      stack.splice(at, 1);
      height -= B.nbytes[b];
      for (j = at; j < stack.length; j += 1) {
        offset[stack[j]] -= B.nbytes[b];
        pts[stack[j]].push([t, offset[stack[j]]]);
      }
    });
    return pts;
  }

  function phaseAt(data, t) {
    for (var i = 0; i < data.phases.length; i += 1) {
      var r = data.phases[i];
      if (t >= r[0] && t < r[1]) { return data.phase_names[r[2]]; }
    }
    return "end of step";
  }

  function blockTip(data, b) {
    var B = data.blocks, S = data.strings, lines = [];
    var freed = B.free[b] >= data.events
      ? "alive to the end of the step"
      : "freed at event " + B.free[b] + " (" + phaseAt(data, B.free[b]) + ")";
    lines.push(["", S[B.name[b]]]);
    lines.push(["category", data.categories[B.category[b]]]);
    lines.push(["module", S[B.module[b]] || "(none)"]);
    lines.push(["made by", S[B.op[b]] || "(no op)"]);
    lines.push(["size", B.size[b] + " (" + B.nbytes[b] + " bytes)"]);
    lines.push(["lifetime", "allocated at event " + B.alloc[b] + " (" + data.phase_names[B.phase[b]] + "), " +
      freed + "; " + (B.free[b] - B.alloc[b]) + " events"]);
    lines.push(["caching address", fmtBytes(B.addr[b])]);
    if (B.plan) {
      lines.push(["planned offset", B.plan[b] < 0 ? "not planned (dynamic space or fallback)" : fmtBytes(B.plan[b])]);
    }
    return lines;
  }

  function Panel(host, title, height, ymax) {
    this.box = el("div", "mp-panel");
    this.box.appendChild(el("div", "mp-panel-title", title));
    this.canvas = el("canvas");
    this.canvas.style.width = "100%";
    this.canvas.style.height = height + "px";
    this.box.appendChild(this.canvas);
    host.appendChild(this.box);
    this.height = height;
    this.ymax = Math.max(1, ymax);
  }
  Panel.prototype.begin = function (view) {
    var dpr = window.devicePixelRatio || 1, w = this.canvas.clientWidth || 600;
    this.canvas.width = Math.round(w * dpr);
    this.canvas.height = Math.round(this.height * dpr);
    var ctx = this.canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, this.height);
    this.w = w;
    this.view = view;
    this.ctx = ctx;
    return ctx;
  };
  Panel.prototype.sx = function (t) {
    return LEFT + (t - this.view.x0) / (this.view.x1 - this.view.x0) * (this.w - LEFT - RIGHT);
  };
  Panel.prototype.sy = function (bytes) {
    return this.height - BOTTOM - bytes / this.ymax * (this.height - TOP - BOTTOM);
  };
  Panel.prototype.tAt = function (px) {
    return this.view.x0 + (px - LEFT) / (this.w - LEFT - RIGHT) * (this.view.x1 - this.view.x0);
  };
  Panel.prototype.bytesAt = function (py) {
    return (this.height - BOTTOM - py) / (this.height - TOP - BOTTOM) * this.ymax;
  };
  Panel.prototype.rect = function (t0, t1, y0, y1) {
    var a = Math.max(this.sx(t0), LEFT), b = Math.min(this.sx(t1), this.w - RIGHT);
    if (b <= a) { return; }
    var top = this.sy(y1), h = this.sy(y0) - top;
    this.ctx.fillRect(a, top, Math.max(b - a, 0.5), Math.max(h, 0.5));
  };
  Panel.prototype.frame = function (data) {
    var ctx = this.ctx, i;
    data.phases.forEach(function (r) {
      ctx.fillStyle = data.phase_colors[r[2]];
      this.rect(r[0], r[1], 0, this.ymax);
    }, this);
    ctx.fillStyle = "#333";
    ctx.font = "11px sans-serif";
    ctx.textAlign = "right";
    for (i = 0; i <= 4; i += 1) {
      var v = this.ymax * i / 4, y = this.sy(v);
      ctx.fillText(fmtBytes(v), LEFT - 4, y + 4);
      ctx.fillRect(LEFT - 2, y, 2, 1);
    }
    for (i = 0; i <= 4; i += 1) {
      var t = this.view.x0 + (this.view.x1 - this.view.x0) * i / 4;
      ctx.textAlign = i === 4 ? "right" : "center";  // the last label ends at the frame's edge
      ctx.fillText(String(Math.round(t)), this.sx(t), this.height - 6);
    }
    ctx.strokeStyle = "#999";
    ctx.strokeRect(LEFT, TOP, this.w - LEFT - RIGHT, this.height - TOP - BOTTOM);
  };
  Panel.prototype.clip = function () {
    this.ctx.save();
    this.ctx.beginPath();
    this.ctx.rect(LEFT, TOP, this.w - LEFT - RIGHT, this.height - TOP - BOTTOM);
    this.ctx.clip();
  };

  function stackedPanel(host, data, pts) {
    var B = data.blocks, ymax = data.peak;
    data.overlays.forEach(function (o) { ymax = Math.max(ymax, o.peak); });
    var p = new Panel(host, "Live memory (" + data.label + ")", 320, ymax * 1.05);
    p.draw = function () {
      var ctx = p.ctx, S = data.small, i, k, c;
      p.frame(data);
      p.clip();
      for (i = 0; i < B.id.length; i += 1) {
        if (B.free[i] < p.view.x0 || B.alloc[i] > p.view.x1) { continue; }
        ctx.fillStyle = data.category_colors[B.category[i]];
        var q = pts[i];
        for (k = 0; k < q.length; k += 1) {
          var end = k + 1 < q.length ? q[k + 1][0] : B.free[i];
          p.rect(q[k][0], end, q[k][1], q[k][1] + B.nbytes[i]);
        }
      }
      ctx.globalAlpha = 0.45;
      for (k = 0; k < S.t.length; k += 1) {
        var t1 = k + 1 < S.t.length ? S.t[k + 1] : data.events, base = S.drawn[k];
        for (c = 0; c < S.by_category.length; c += 1) {
          var v = S.by_category[c][k];
          if (v <= 0) { continue; }
          ctx.fillStyle = data.category_colors[c];
          p.rect(S.t[k], t1, base, base + v);
          base += v;
        }
      }
      ctx.globalAlpha = 1;
      data.overlays.forEach(function (o, j) {
        ctx.strokeStyle = OVERLAY[j % OVERLAY.length];
        ctx.setLineDash([5, 3]);
        ctx.lineWidth = 1.5;
        ctx.beginPath();
        for (k = 0; k < o.t.length; k += 1) {
          var x = p.sx(o.t[k]), y = p.sy(o.bytes[k]);
          if (k === 0) { ctx.moveTo(x, y); } else { ctx.lineTo(x, y); }
        }
        ctx.stroke();
        ctx.setLineDash([]);
        ctx.lineWidth = 1;
      });
      ctx.restore();
    };
    p.hit = function (t, y) {
      for (var i = 0; i < B.id.length; i += 1) {
        if (t < B.alloc[i] || t >= B.free[i]) { continue; }
        var q = pts[i], off = q[0][1];
        for (var k = 1; k < q.length && q[k][0] <= t; k += 1) { off = q[k][1]; }
        if (y >= off && y < off + B.nbytes[i]) { return blockTip(data, i); }
      }
      return smallTip(data, t, y);
    };
    return p;
  }

  function smallTip(data, t, y) {
    var S = data.small, k = 0;
    if (!S.t.length || !S.count) { return null; }
    while (k + 1 < S.t.length && S.t[k + 1] <= t) { k += 1; }
    var total = 0, lines;
    S.by_category.forEach(function (col) { total += col[k]; });
    if (y < S.drawn[k] || y >= S.drawn[k] + total) { return null; }
    lines = [["", "small tensors (" + S.count + ", each at most " + fmtBytes(S.largest) + ")"]];
    S.by_category.forEach(function (col, c) {
      if (col[k] > 0) { lines.push([data.categories[c], fmtBytes(col[k])]); }
    });
    return lines;
  }

  function addressPanel(host, data, title, key, ymax, segments) {
    var B = data.blocks, p = new Panel(host, title, 240, ymax * 1.02);
    p.draw = function () {
      var ctx = p.ctx, i;
      p.frame(data);
      p.clip();
      if (segments) {
        for (i = 0; i < segments.start.length; i += 1) {
          ctx.fillStyle = "#e4e4e4";
          p.rect(segments.start[i], segments.end[i], segments.addr[i], segments.addr[i] + segments.nbytes[i]);
        }
      }
      for (i = 0; i < B.id.length; i += 1) {
        if (B[key][i] < 0 || B.free[i] < p.view.x0 || B.alloc[i] > p.view.x1) { continue; }
        ctx.fillStyle = data.category_colors[B.category[i]];
        p.rect(B.alloc[i], B.free[i], B[key][i], B[key][i] + B.nbytes[i]);
      }
      ctx.restore();
    };
    p.hit = function (t, y) {
      for (var i = 0; i < B.id.length; i += 1) {
        var a = B[key][i];
        if (a >= 0 && t >= B.alloc[i] && t < B.free[i] && y >= a && y < a + B.nbytes[i]) {
          return blockTip(data, i);
        }
      }
      return segments ? segmentTip(data, segments, t, y) : null;
    };
    return p;
  }

  function segmentTip(data, S, t, y) {
    for (var i = 0; i < S.start.length; i += 1) {
      if (t >= S.start[i] && t < S.end[i] && y >= S.addr[i] && y < S.addr[i] + S.nbytes[i]) {
        return [["", "segment of " + fmtBytes(S.nbytes[i]) + " (free space inside it)"],
          ["cudaMalloc", "event " + S.start[i] + " (" + phaseAt(data, S.start[i]) + ")"],
          ["cudaFree", S.end[i] >= data.events ? "kept to the end of the step" : "event " + S.end[i]],
          ["address", fmtBytes(S.addr[i]) + " from the first segment"]];
      }
    }
    return null;
  }

  function maxEnd(starts, sizes) {
    var m = 0;
    for (var i = 0; i < starts.length; i += 1) { m = Math.max(m, starts[i] + sizes[i]); }
    return m;
  }

  function legend(data) {
    var box = el("div", "mp-legend");
    data.categories.forEach(function (c, i) {
      var item = el("span", "mp-key");
      var sw = el("span", "mp-swatch");
      sw.style.background = data.category_colors[i];
      item.appendChild(sw);
      item.appendChild(document.createTextNode(c));
      box.appendChild(item);
    });
    data.overlays.forEach(function (o, j) {
      var item = el("span", "mp-key", "- - " + o.label + " (peak " + fmtBytes(o.peak) + ")");
      item.style.color = OVERLAY[j % OVERLAY.length];
      box.appendChild(item);
    });
    return box;
  }

  function showTip(tip, lines, ev) {
    tip.textContent = "";
    lines.forEach(function (l) {
      var row = el("div");
      if (l[0]) { row.appendChild(el("b", null, l[0] + ": ")); } else { row.className = "mp-tip-head"; }
      row.appendChild(document.createTextNode(l[1]));
      tip.appendChild(row);
    });
    tip.style.display = "block";
    tip.style.left = (ev.clientX + 14) + "px";
    tip.style.top = (ev.clientY + 14) + "px";
  }

  function interact(p, state, tip) {
    var c = p.canvas, drag = null;
    c.addEventListener("wheel", function (ev) {
      ev.preventDefault();
      var r = c.getBoundingClientRect(), t = p.tAt(ev.clientX - r.left), v = state.view;
      var f = ev.deltaY < 0 ? 1 / 1.25 : 1.25, w = Math.min(state.events, Math.max(2, (v.x1 - v.x0) * f));
      var x0 = Math.min(Math.max(0, t - (t - v.x0) * w / (v.x1 - v.x0)), state.events - w);
      v.x0 = x0;
      v.x1 = x0 + w;
      state.redraw();
    }, {passive: false});
    c.addEventListener("mousedown", function (ev) { drag = [ev.clientX, state.view.x0, state.view.x1]; });
    window.addEventListener("mouseup", function () { drag = null; });
    c.addEventListener("dblclick", function () {
      state.view.x0 = 0;
      state.view.x1 = state.events;
      state.redraw();
    });
    c.addEventListener("mouseleave", function () { tip.style.display = "none"; });
    c.addEventListener("mousemove", function (ev) {
      var r = c.getBoundingClientRect(), px = ev.clientX - r.left, py = ev.clientY - r.top, v = state.view;
      if (drag) {
        var dt = (drag[0] - ev.clientX) / (p.w - LEFT - RIGHT) * (drag[2] - drag[1]);
        var x0 = Math.min(Math.max(0, drag[1] + dt), state.events - (drag[2] - drag[1]));
        v.x0 = x0;
        v.x1 = x0 + (drag[2] - drag[1]);
        state.redraw();
        return;
      }
      var lines = px >= LEFT ? p.hit(p.tAt(px), p.bytesAt(py)) : null;
      if (lines) { showTip(tip, lines, ev); } else { tip.style.display = "none"; }
    });
  }

  function build(host) {
    var data = JSON.parse(document.getElementById(host.getAttribute("data-src")).textContent);
    host.setAttribute("data-drawn", "1");
    var B = data.blocks, pts = stackBlocks(B), tip = el("div", "mp-tip");
    tip.style.display = "none";
    document.body.appendChild(tip);
    host.appendChild(el("div", "mp-hint", "Wheel: zoom the time axis · drag: pan · double click: whole step · " +
      "hover a block for its tensor. " + B.id.length + " of " + data.buffers + " tensors drawn one by one."));
    host.appendChild(legend(data));
    var panels = [stackedPanel(host, data, pts)];
    var row = el("div", "mp-row");
    host.appendChild(row);
    var segEnd = Math.max(maxEnd(data.segments.addr, data.segments.nbytes), maxEnd(B.addr, B.nbytes));
    panels.push(addressPanel(row, data, "Caching allocator: segments (grey) and blocks", "addr", segEnd,
      data.segments));
    if (B.plan) {
      panels.push(addressPanel(row, data, "Plan's arena (" + fmtBytes(data.arena_bytes) + "; " + data.unplanned +
        " requests unplanned)", "plan", Math.max(data.arena_bytes, 1), null));
    }
    var state = {view: {x0: 0, x1: Math.max(1, data.events)}, events: Math.max(1, data.events)};
    state.redraw = function () {
      panels.forEach(function (p) { p.begin(state.view); p.draw(); });
    };
    panels.forEach(function (p) { interact(p, state, tip); });
    window.addEventListener("resize", state.redraw);
    state.redraw();
    host.memplanState = state;
  }

  function drawAll() {
    var hosts = document.querySelectorAll(".mp-timeline:not([data-drawn])");
    for (var i = 0; i < hosts.length; i += 1) { build(hosts[i]); }
  }

  window.memplanTimeline = {drawAll: drawAll, fmtBytes: fmtBytes};
  drawAll();
})();
