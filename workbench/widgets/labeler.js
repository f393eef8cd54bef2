// The preference labeler's front end (Labeler and LiveLabeler). Python owns every decision (which
// item, which side is A, what was recorded, what the keys mean: the `keymap` trait); this file shows
// the current pair and sends the person's action as a custom message:
//   {type: "label", choice, rating, rationale, item_id, dwell_ms}, {type: "edit", side, text, ...},
//   {type: "undo"}.
// Keys never fire while a text field (the rationale, the editor) has focus, so typing cannot label
// an item; Escape leaves the field. A LiveLabeler (`live`) also shows which weights made the pair,
// the updates, the queue and a small chart; those change while the person labels and never move the
// pair on show or the keyboard focus.

// The action for a keydown event under `keymap` (key -> action), or null. A shifted key that is not
// a character is looked up as "Shift+<key>" (Shift+ArrowLeft). Exported for tests without a browser.
export function shortcutFor(event, keymap) {
  const tag = (event.target && event.target.tagName || "").toUpperCase();
  if (tag === "TEXTAREA" || tag === "INPUT" || (event.target && event.target.isContentEditable)) return null;
  if (event.ctrlKey || event.metaKey || event.altKey || event.isComposing) return null;
  const key = String(event.key);
  const name = event.shiftKey && key.length > 1 ? `Shift+${key}` : key;
  return keymap[name] ?? keymap[name.toLowerCase()] ?? null;
}

const CSS = `
.wb-lab{font:13px sans-serif;outline:none;border:1px solid #ddd;border-radius:6px;padding:8px}
.wb-lab:focus{border-color:#60a5fa}
.wb-lab .wb-prompt{background:#f6f6f6;padding:6px;border-radius:4px;white-space:pre-wrap;margin:6px 0}
.wb-lab .wb-pair{display:flex;gap:8px}
.wb-lab .wb-side{flex:1;border:1px solid #ccc;border-radius:4px;padding:6px;white-space:pre-wrap;max-height:360px;overflow:auto}
.wb-lab .wb-side h4{margin:0 0 4px 0}
.wb-lab .wb-buttons,.wb-lab .wb-rating{display:flex;gap:6px;flex-wrap:wrap;margin:8px 0;align-items:center}
.wb-lab textarea{width:100%;box-sizing:border-box}
.wb-lab .wb-muted{color:#666}
.wb-lab .wb-cut{color:#666;font-style:italic}
.wb-lab .wb-message{color:#92400e;margin:4px 0}
.wb-lab .wb-live{display:flex;gap:16px;align-items:flex-start;margin:4px 0 6px 0}
.wb-lab .wb-live-text div{margin:2px 0}
.wb-lab .wb-version{font-weight:600}
.wb-lab .wb-rating button.wb-on{background:#dbeafe;border-color:#60a5fa}
.wb-lab .wb-edit{border:1px dashed #60a5fa;border-radius:4px;padding:6px;margin:6px 0}
.wb-lab .wb-count-row{display:flex;align-items:center;gap:4px;line-height:14px}
.wb-lab .wb-count-name{display:inline-block;width:68px}
.wb-lab .wb-bar{display:inline-block;height:9px;background:#93c5fd;border-radius:2px}
`;

// [action, button text]; the keys bound to each come from the keymap.
const BUTTONS = [
  ["A", "A better"], ["A_slightly", "A slightly"], ["tie", "Tie"], ["B_slightly", "B slightly"],
  ["B", "B better"], ["both_bad", "Both bad"], ["skip", "Skip"], ["edit", "Edit"], ["undo", "Undo"],
];
const PRETTY = { ArrowLeft: "←", ArrowRight: "→", " ": "space", "Shift+ArrowLeft": "⇧←", "Shift+ArrowRight": "⇧→" };

function keysFor(keymap, action) {
  return Object.entries(keymap).filter(([, a]) => a === action).map(([k]) => PRETTY[k] ?? k).join(" / ");
}

// The held-out margin gain per update as an SVG line (the LiveLabeler's `chart` rows).
function chartSvg(rows) {
  const w = 240, h = 80, pad = 18;
  const points = rows.filter((r) => Number.isFinite(r.heldout_gain));
  if (points.length === 0) return `<svg width="${w}" height="${h}"></svg>`;
  const ys = points.map((r) => r.heldout_gain).concat([0]);
  const lo = Math.min(...ys), hi = Math.max(...ys), span = hi - lo || 1;
  const end = points[points.length - 1], last = Math.max(1, end.step);
  const x = (u) => pad + (u / last) * (w - 2 * pad), y = (v) => h - pad - ((v - lo) / span) * (h - 2 * pad);
  const path = points.map((r, i) => `${i ? "L" : "M"}${x(r.step).toFixed(1)},${y(r.heldout_gain).toFixed(1)}`).join("");
  const dots = points.map((r) => `<circle class="wb-point" cx="${x(r.step).toFixed(1)}" cy="${y(r.heldout_gain).toFixed(1)}" r="3" fill="#2563eb"><title>update ${r.step}: ${r.heldout_gain.toFixed(2)} on ${r.heldout_pairs} held-out pairs</title></circle>`).join("");
  const endY = y(end.heldout_gain) < 30 ? y(end.heldout_gain) + 14 : y(end.heldout_gain) - 6;  // below the point near the top
  return `<svg width="${w}" height="${h}" class="wb-chart">
    <line x1="${pad}" x2="${w - pad}" y1="${y(0).toFixed(1)}" y2="${y(0).toFixed(1)}" stroke="#ccc"/>
    <path d="${path}" fill="none" stroke="#2563eb" stroke-width="2"/>${dots}
    <text x="${pad}" y="11" font-size="10" fill="#444">held-out margin gain over the start, per update</text>
    <text x="${w - pad}" y="${h - 4}" font-size="10" fill="#666" text-anchor="end">update ${last}</text>
    <text x="${pad}" y="${h - 4}" font-size="10" fill="#666">0</text>
    <text class="wb-last-gain" x="${(x(end.step) - 4).toFixed(1)}" y="${endY.toFixed(1)}" font-size="10" fill="#2563eb" text-anchor="end">${end.heldout_gain >= 0 ? "+" : ""}${end.heldout_gain.toFixed(2)}</text></svg>`;
}

// The labels so far, one bar per judgment (the LiveLabeler's `counts`: choice -> n).
function countsHtml(counts) {
  const rows = Object.entries(counts).filter(([, n]) => n > 0);
  if (rows.length === 0) return "labels: none yet";
  const most = Math.max(...rows.map(([, n]) => n));
  return rows.map(([choice, n]) => `<div class="wb-count-row" data-choice="${choice}"><span class="wb-count-name">${choice.replace("_", " ")}</span>`
    + `<span class="wb-bar" style="width:${Math.max(2, Math.round(80 * n / most))}px"></span> ${n}</div>`).join("");
}

export default {
  render({ model, el }) {
    const root = document.createElement("div");
    root.className = "wb-lab";
    root.tabIndex = 0;  // focusable, so shortcuts go to this widget and not to the notebook
    root.dataset.lmSuppressShortcuts = "true";  // JupyterLab: don't treat our keys as notebook commands
    root.innerHTML = `<style>${CSS}</style>
      <div class="wb-progress"><progress></progress> <span class="wb-count"></span> <span class="wb-muted wb-last"></span>
        <span class="wb-muted wb-agreement"></span></div>
      <div class="wb-live" style="display:none"><div class="wb-live-text">
        <div class="wb-version"></div><div class="wb-updates"></div><div class="wb-status wb-muted"></div>
        <div class="wb-counts wb-muted"></div></div><div class="wb-chart-box"></div></div>
      <div class="wb-message"></div>
      <div class="wb-prompt"></div>
      <div class="wb-pair">
        <div class="wb-side"><h4>A</h4><span class="wb-a"></span><span class="wb-cut wb-cut-a"> … (cut off: the sample reached its token limit)</span></div>
        <div class="wb-side"><h4>B</h4><span class="wb-b"></span><span class="wb-cut wb-cut-b"> … (cut off: the sample reached its token limit)</span></div>
      </div>
      <div class="wb-edit" style="display:none">
        <div>Rewrite answer <button data-side="A">A</button> <button data-side="B">B</button>
          <span class="wb-muted">as you would want it; it trains as "your answer beats the original".</span></div>
        <textarea class="wb-edit-text" rows="4"></textarea>
        <button class="wb-edit-save">Save edit [Ctrl+Enter]</button> <button class="wb-edit-cancel">Cancel [Esc]</button>
      </div>
      <div class="wb-rating" style="display:none"><span class="wb-rubric"></span></div>
      <div class="wb-buttons"></div>
      <textarea class="wb-rationale" rows="2" placeholder="optional rationale (shortcuts are off while typing here; Esc to leave)"></textarea>
      <div class="wb-done" style="display:none"><b>All items labelled.</b> <span class="wb-muted">z undoes the last one.</span></div>
      <div class="wb-keys wb-muted"></div>`;
    el.appendChild(root);
    const $ = (s) => root.querySelector(s);
    const rationale = $(".wb-rationale"), editor = $(".wb-edit"), editText = $(".wb-edit-text");
    let shownAt = Date.now(), rating = null, editSide = "A";

    const startEdit = (side) => {
      editSide = side;
      editText.value = model.get(side === "A" ? "text_a" : "text_b");
      editor.style.display = "block";
      for (const b of editor.querySelectorAll("[data-side]")) b.disabled = b.dataset.side === side;
      editText.focus();
    };
    const stopEdit = () => { editor.style.display = "none"; root.focus({ preventScroll: true }); };
    const act = (action) => {
      if (action === "undo") { model.send({ type: "undo" }); return; }
      if (action.startsWith("rate:")) { setRating(Number(action.slice(5))); return; }
      if (model.get("finished")) return;
      if (action === "edit") { startEdit("A"); return; }
      model.send({ type: "label", choice: action, rating, rationale: rationale.value,
                   item_id: model.get("item_id"), dwell_ms: Date.now() - shownAt });
    };
    const saveEdit = () => {
      model.send({ type: "edit", side: editSide, text: editText.value, rationale: rationale.value,
                   item_id: model.get("item_id") });
      stopEdit();
    };
    editor.querySelectorAll("[data-side]").forEach((b) => b.addEventListener("click", () => startEdit(b.dataset.side)));
    $(".wb-edit-save").addEventListener("click", saveEdit);
    $(".wb-edit-cancel").addEventListener("click", stopEdit);
    editText.addEventListener("keydown", (event) => {
      event.stopPropagation();  // typing here is text, never a shortcut or a notebook command
      if (event.key === "Escape") stopEdit();
      if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) { event.preventDefault(); saveEdit(); }
    });

    const setRating = (n) => {
      rating = rating === n ? null : n;
      for (const b of root.querySelectorAll(".wb-rating button")) b.classList.toggle("wb-on", Number(b.dataset.rate) === rating);
    };
    for (let n = 1; n <= 5; n++) {
      const b = document.createElement("button");
      b.textContent = String(n);
      b.dataset.rate = String(n);
      b.addEventListener("click", () => { setRating(n); root.focus({ preventScroll: true }); });
      $(".wb-rating").appendChild(b);
    }
    const drawButtons = () => {
      const keymap = model.get("keymap");
      $(".wb-buttons").replaceChildren(...BUTTONS.map(([action, label]) => {
        const button = document.createElement("button");
        const keys = keysFor(keymap, action);
        button.textContent = keys ? `${label} [${keys}]` : label;
        button.dataset.action = action;
        button.addEventListener("click", () => { act(action); if (action !== "edit") root.focus({ preventScroll: true }); });
        return button;
      }));
      $(".wb-keys").textContent = "Keys: " + BUTTONS.map(([a, l]) => [l, keysFor(keymap, a)]).filter(([, k]) => k)
        .map(([l, k]) => `${k} ${l.toLowerCase()}`).join(" · ") + " (rebind with keys={...})";
    };
    root.addEventListener("keydown", (event) => {
      if (event.target === rationale && event.key === "Escape") { rationale.blur(); root.focus(); return; }
      const action = shortcutFor(event, model.get("keymap"));
      if (action === null) return;
      event.preventDefault();
      event.stopPropagation();
      act(action);
    });

    const draw = () => {
      const done = model.get("done"), total = model.get("total"), finished = model.get("finished");
      const live = model.get("live");
      $("progress").max = Math.max(total, 1);
      $("progress").value = done;
      $("progress").style.display = live ? "none" : "";
      $(".wb-count").textContent = live ? `${done} labelled` : `${done} / ${total}`;
      $(".wb-last").textContent = model.get("last_action");
      $(".wb-agreement").textContent = model.get("self_agreement") ? `· ${model.get("self_agreement")}` : "";
      $(".wb-message").textContent = model.get("message");
      $(".wb-prompt").textContent = model.get("prompt");
      $(".wb-a").textContent = model.get("text_a");
      $(".wb-b").textContent = model.get("text_b");
      $(".wb-cut-a").style.display = model.get("cut_a") ? "inline" : "none";
      $(".wb-cut-b").style.display = model.get("cut_b") ? "inline" : "none";
      $(".wb-pair").style.display = finished ? "none" : "flex";
      $(".wb-prompt").style.display = finished ? "none" : "block";
      $(".wb-done").style.display = finished && !live ? "block" : "none";
      $(".wb-rating").style.display = model.get("rubric") ? "flex" : "none";
      $(".wb-rubric").textContent = `Rating: ${model.get("rubric")}`;
      const undo = root.querySelector('[data-action="undo"]');
      if (undo) undo.disabled = !model.get("can_undo");
    };
    const drawLive = () => {
      if (!model.get("live")) return;
      $(".wb-live").style.display = "flex";
      const shown = model.get("finished") ? "no pair on show" : `this pair: sampled by weights v${model.get("policy_version")}`;
      $(".wb-version").textContent = `${shown} · latest weights v${model.get("current_version")}`;
      $(".wb-updates").textContent = `${model.get("updates_done")} updates done${model.get("updating") ? " · an update is training now (keep labelling)" : ""}`
        + ` · order: ${model.get("ordering")}`;
      $(".wb-status").textContent = model.get("status");
      $(".wb-counts").innerHTML = countsHtml(model.get("counts"));
      $(".wb-chart-box").innerHTML = chartSvg(model.get("chart"));
    };
    const newItem = () => { shownAt = Date.now(); rationale.value = model.get("rationale"); setRating(null); draw(); drawLive(); };
    const fields = ["done", "total", "finished", "last_action", "message", "prompt", "text_a", "text_b", "cut_a",
                    "cut_b", "can_undo", "rubric", "self_agreement", "live"];
    const liveFields = ["policy_version", "current_version", "updates_done", "updating", "status", "ordering",
                        "counts", "chart"];
    for (const f of fields) model.on(`change:${f}`, draw);
    for (const f of liveFields) model.on(`change:${f}`, drawLive);
    model.on("change:item_id", newItem);
    model.on("change:keymap", drawButtons);
    drawButtons();
    newItem();
    requestAnimationFrame(() => root.focus({ preventScroll: true }));
    return () => {
      for (const f of fields) model.off(`change:${f}`, draw);
      for (const f of liveFields) model.off(`change:${f}`, drawLive);
      model.off("change:item_id", newItem);
      model.off("change:keymap", drawButtons);
    };
  },
};
