// Line charts in plain SVG: one line per model over the last 15 minutes.

const COLOURS = ["#2f6feb", "#cf222e", "#1a7f37", "#9a6700", "#8250df", "#0a7ea4", "#bf3989"];
const W = 400, H = 120, PAD = { left: 34, right: 6, top: 8, bottom: 18 };
const SPAN_S = 15 * 60;
const NS = "http://www.w3.org/2000/svg";

export function colour(index) {
  return COLOURS[index % COLOURS.length];
}

function el(name, attrs, text) {
  const node = document.createElementNS(NS, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

// `series`: {model: [{at, value}]}; `order`: model names, for stable colours.
export function drawLines(svg, series, order, now) {
  svg.replaceChildren();
  const values = Object.values(series).flat().map((p) => p.value);
  const max = Math.max(1, ...values);
  const x = (at) => PAD.left + ((at - (now - SPAN_S)) / SPAN_S) * (W - PAD.left - PAD.right);
  const y = (v) => H - PAD.bottom - (v / max) * (H - PAD.top - PAD.bottom);
  for (const frac of [0, 0.5, 1]) {
    const v = max * frac;
    svg.append(el("line", { x1: PAD.left, x2: W - PAD.right, y1: y(v), y2: y(v), stroke: "#e4e7ec" }));
    svg.append(el("text", { x: PAD.left - 4, y: y(v) + 3, "text-anchor": "end", "font-size": 9, fill: "#667085" },
      Number.isInteger(v) ? v : v.toFixed(1)));
  }
  for (const [label, at] of [["-15 min", now - SPAN_S], ["-5", now - 300], ["now", now]]) {
    const anchor = at === now ? "end" : at === now - SPAN_S ? "start" : "middle";
    svg.append(el("text", { x: x(at), y: H - 4, "text-anchor": anchor, "font-size": 9, fill: "#667085" }, label));
  }
  for (const [model, points] of Object.entries(series)) {
    if (!points.length) continue;
    const d = points.map((p, i) => `${i ? "L" : "M"}${x(p.at).toFixed(1)},${y(p.value).toFixed(1)}`).join(" ");
    const path = el("path", { d, fill: "none", stroke: colour(order.indexOf(model)), "stroke-width": 1.5 });
    path.append(el("title", {}, model));
    svg.append(path);
  }
}
