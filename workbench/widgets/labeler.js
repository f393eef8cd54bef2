// The preference labeler's front end. Python owns every decision (which item, which side is A,
// what was recorded); this file shows the current pair and sends the user's choice as a custom
// message: {type: "label", choice, rationale, item_id, dwell_ms} or {type: "undo"}.
//
// Shortcuts: 1 / ← A, 2 / → B, t tie, b both bad, s / space skip, z / Backspace undo.
// They never fire while the rationale box (or any text field) has focus, so typing a rationale
// cannot label an item; Escape leaves the box.

const KEYS = {
  "1": "A", "ArrowLeft": "A", "2": "B", "ArrowRight": "B",
  "t": "tie", "b": "both_bad", "s": "skip", " ": "skip", "z": "undo", "Backspace": "undo",
};

// The action for a keydown event, or null. Exported so it can be tested without a browser.
export function shortcutFor(event) {
  const tag = (event.target && event.target.tagName || "").toUpperCase();
  if (tag === "TEXTAREA" || tag === "INPUT" || (event.target && event.target.isContentEditable)) return null;
  if (event.ctrlKey || event.metaKey || event.altKey || event.isComposing) return null;
  return KEYS[event.key] ?? KEYS[String(event.key).toLowerCase()] ?? null;
}

const CSS = `
.wb-lab{font:13px sans-serif;outline:none;border:1px solid #ddd;border-radius:6px;padding:8px}
.wb-lab:focus{border-color:#60a5fa}
.wb-lab .wb-prompt{background:#f6f6f6;padding:6px;border-radius:4px;white-space:pre-wrap;margin:6px 0}
.wb-lab .wb-pair{display:flex;gap:8px}
.wb-lab .wb-side{flex:1;border:1px solid #ccc;border-radius:4px;padding:6px;white-space:pre-wrap;max-height:360px;overflow:auto}
.wb-lab .wb-side h4{margin:0 0 4px 0}
.wb-lab .wb-buttons{display:flex;gap:6px;flex-wrap:wrap;margin:8px 0}
.wb-lab textarea{width:100%;box-sizing:border-box}
.wb-lab .wb-muted{color:#666}
.wb-lab .wb-cut{color:#666;font-style:italic}
`;

const BUTTONS = [
  ["A", "A is better", "1 / ←"], ["tie", "Tie", "t"], ["both_bad", "Both bad", "b"],
  ["skip", "Skip", "s"], ["B", "B is better", "2 / →"], ["undo", "Undo", "z"],
];

export default {
  render({ model, el }) {
    const root = document.createElement("div");
    root.className = "wb-lab";
    root.tabIndex = 0;  // focusable, so shortcuts go to this widget and not to the notebook
    root.dataset.lmSuppressShortcuts = "true";  // JupyterLab: don't treat our keys as notebook commands
    root.innerHTML = `<style>${CSS}</style>
      <div class="wb-progress"><progress></progress> <span class="wb-count"></span> <span class="wb-muted wb-last"></span></div>
      <div class="wb-prompt"></div>
      <div class="wb-pair">
        <div class="wb-side"><h4>A</h4><span class="wb-a"></span><span class="wb-cut wb-cut-a"> … (cut off: the sample reached its token limit)</span></div>
        <div class="wb-side"><h4>B</h4><span class="wb-b"></span><span class="wb-cut wb-cut-b"> … (cut off: the sample reached its token limit)</span></div>
      </div>
      <div class="wb-buttons"></div>
      <textarea rows="2" placeholder="optional rationale (shortcuts are off while typing here; Esc to leave)"></textarea>
      <div class="wb-done" style="display:none"><b>All items labelled.</b> <span class="wb-muted">z undoes the last one.</span></div>`;
    el.appendChild(root);
    const $ = (s) => root.querySelector(s);
    const rationale = $("textarea");
    let shownAt = Date.now();

    const act = (action) => {
      if (action === "undo") { model.send({ type: "undo" }); return; }
      if (model.get("finished")) return;
      model.send({ type: "label", choice: action, rationale: rationale.value,
                   item_id: model.get("item_id"), dwell_ms: Date.now() - shownAt });
    };
    for (const [action, label, key] of BUTTONS) {
      const button = document.createElement("button");
      button.textContent = `${label} [${key}]`;
      button.dataset.action = action;
      button.addEventListener("click", () => { act(action); root.focus({ preventScroll: true }); });
      $(".wb-buttons").appendChild(button);
    }
    root.addEventListener("keydown", (event) => {
      if (event.target === rationale && event.key === "Escape") { rationale.blur(); root.focus(); return; }
      const action = shortcutFor(event);
      if (action === null) return;
      event.preventDefault();
      event.stopPropagation();
      act(action);
    });

    const draw = () => {
      const done = model.get("done"), total = model.get("total"), finished = model.get("finished");
      $("progress").max = Math.max(total, 1);
      $("progress").value = done;
      $(".wb-count").textContent = `${done} / ${total}`;
      $(".wb-last").textContent = model.get("last_action");
      $(".wb-prompt").textContent = model.get("prompt");
      $(".wb-a").textContent = model.get("text_a");
      $(".wb-b").textContent = model.get("text_b");
      $(".wb-cut-a").style.display = model.get("cut_a") ? "inline" : "none";
      $(".wb-cut-b").style.display = model.get("cut_b") ? "inline" : "none";
      $(".wb-pair").style.display = finished ? "none" : "flex";
      $(".wb-prompt").style.display = finished ? "none" : "block";
      $(".wb-done").style.display = finished ? "block" : "none";
      root.querySelector('[data-action="undo"]').disabled = !model.get("can_undo");
    };
    const newItem = () => { shownAt = Date.now(); rationale.value = model.get("rationale"); draw(); };
    const fields = ["done", "total", "finished", "last_action", "prompt", "text_a", "text_b", "cut_a", "cut_b", "can_undo"];
    for (const f of fields) model.on(`change:${f}`, draw);
    model.on("change:item_id", newItem);
    newItem();
    requestAnimationFrame(() => root.focus({ preventScroll: true }));
    return () => {
      for (const f of fields) model.off(`change:${f}`, draw);
      model.off("change:item_id", newItem);
    };
  },
};
