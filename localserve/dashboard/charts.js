// Small time charts on plain canvas: no library, nothing fetched.
"use strict";
const Charts = {
  // The canvas sized to its box at the screen's pixel ratio, cleared: its context and CSS size.
  clear(canvas) {
    const ratio = window.devicePixelRatio || 1;
    const w = canvas.clientWidth, h = canvas.clientHeight;
    if (canvas.width !== w * ratio) { canvas.width = w * ratio; canvas.height = h * ratio; }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, w, h);
    return { ctx, w, h };
  },
  // series: [{values: [numbers], color}], drawn over the same x range; y from 0 to the max seen.
  draw(canvas, series) {
    const { ctx, w, h } = Charts.clear(canvas);
    const n = Math.max(2, ...series.map((s) => s.values.length));
    const top = Math.max(1e-9, ...series.flatMap((s) => s.values));
    for (const s of series) {
      ctx.strokeStyle = s.color; ctx.lineWidth = 1.5; ctx.beginPath();
      s.values.forEach((v, i) => {
        const x = (w * (n - s.values.length + i)) / (n - 1), y = h - 2 - ((h - 4) * v) / top;
        if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
      });
      ctx.stroke();
    }
    ctx.fillStyle = "#656d76"; ctx.font = "10px system-ui"; ctx.fillText(Charts.short(top), 2, 10);
  },
  // Stacked bars, one per point (at least `slots` wide, so a young history is thin bars on the
  // right, not a few wide blocks): `series` stacked from the bottom; `overlay` (optional) as a line.
  stacked(canvas, series, overlay, slots = 60) {
    const { ctx, w, h } = Charts.clear(canvas);
    const n = Math.max(slots, ...series.map((s) => s.values.length));
    const totals = Array.from({ length: n }, (_, i) => series.reduce((sum, s) => sum + (s.values[i - (n - s.values.length)] || 0), 0));
    const top = Math.max(1e-9, ...totals, ...(overlay ? overlay.values : []));
    const bar = w / n;
    for (let i = 0; i < n; i++) {
      let y = h;
      for (const s of series) {
        const v = s.values[i - (n - s.values.length)] || 0;
        const dy = ((h - 2) * v) / top;
        ctx.fillStyle = s.color; ctx.fillRect(i * bar, y - dy, Math.max(1, bar - 0.5), dy);
        y -= dy;
      }
    }
    if (overlay && overlay.values.length) {
      ctx.strokeStyle = overlay.color; ctx.lineWidth = 1.5; ctx.beginPath();
      overlay.values.forEach((v, i) => {
        const x = (n - overlay.values.length + i + 0.5) * bar, y = h - 1 - ((h - 2) * v) / top;
        if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
      });
      ctx.stroke();
    }
    ctx.fillStyle = "#656d76"; ctx.font = "10px system-ui"; ctx.fillText(Charts.short(top), 2, 10);
  },
  short(v) { return v >= 100 ? v.toFixed(0) : v >= 1 ? v.toFixed(1) : v.toFixed(2); },
};
