// The rollout inspector's front end: a filter box, a sortable table, and the selected
// completion's tokens; on a run's stored rollouts (from_log) also ◀ step ▶, the step in words, and
// "this prompt across steps". All state lives in Python traitlets; this file only draws them and
// writes back what the user did (query, sort_column/ascending, selected, color_by, step).
const esc = (s) => String(s ?? "").replace(/[&<>"]/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]));

function set(model, changes) {
  for (const [k, v] of Object.entries(changes)) model.set(k, v);
  model.save_changes();
}

export default {
  render({ model, el }) {
    el.classList.add("wb-rollouts");
    el.innerHTML = `
      <div class="wb-steps" style="display:none;gap:6px;align-items:center;font:12px sans-serif;margin-bottom:4px">
        <b class="wb-label"></b>
        <button class="wb-prev" title="the step before">◀</button>
        <select class="wb-step"></select>
        <button class="wb-next" title="the step after">▶</button>
        <span class="wb-summary"></span>
        <button class="wb-across" title="the selected row's prompt, answered at every step kept">this prompt across steps</button>
      </div>
      <div style="display:flex;gap:8px;align-items:center;font:12px sans-serif;margin-bottom:4px">
        <input class="wb-query" placeholder="filter, e.g. reward > 0 and advantage < 0" style="flex:1">
        <label>colour by <select class="wb-color"><option>logprob</option><option>advantage</option></select></label>
        <span class="wb-count"></span>
      </div>
      <div class="wb-error" style="color:#b00;font:12px sans-serif"></div>
      <div style="max-height:320px;overflow:auto"><table class="wb-table" style="border-collapse:collapse;font:12px sans-serif;width:100%"></table></div>
      <div class="wb-detail" style="margin-top:6px"></div>`;
    const query = el.querySelector(".wb-query"), color = el.querySelector(".wb-color");
    const table = el.querySelector(".wb-table"), stepMenu = el.querySelector(".wb-step");
    query.addEventListener("keydown", (e) => { e.stopPropagation(); if (e.key === "Enter") set(model, {query: query.value}); });
    color.addEventListener("change", () => set(model, {color_by: color.value}));
    // A step: the one before or after among the steps kept (a long run's log keeps its first and newest).
    const go = (offset) => {
      const steps = model.get("steps"), at = steps.indexOf(model.get("step"));
      const next = steps[Math.min(Math.max(at + offset, 0), steps.length - 1)];
      if (next !== undefined) set(model, {history_prompt: "", step: next, follow: false});
    };
    el.querySelector(".wb-prev").addEventListener("click", () => go(model.get("history_prompt") ? 0 : -1));
    el.querySelector(".wb-next").addEventListener("click", () => go(model.get("history_prompt") ? 0 : 1));
    stepMenu.addEventListener("change", () => set(model, {history_prompt: "", step: Number(stepMenu.value), follow: false}));
    el.querySelector(".wb-across").addEventListener("click", () => { set(model, {follow: false}); model.send({type: "across_steps"}); });

    const draw = () => {
      query.value = model.get("query");
      color.value = model.get("color_by");
      el.querySelector(".wb-error").textContent = model.get("error");
      const steps = model.get("steps"), step = model.get("step"), following = model.get("history_prompt");
      el.querySelector(".wb-steps").style.display = steps.length ? "flex" : "none";
      stepMenu.innerHTML = steps.map((s) => `<option value="${s}">step ${s}</option>`).join("");
      stepMenu.value = String(step);
      el.dataset.step = following ? "" : String(step);
      el.querySelector(".wb-summary").textContent = model.get("summary");
      el.querySelector(".wb-label").textContent = model.get("label");
      el.querySelector(".wb-across").disabled = model.get("selected") < 0;
      const rows = model.get("rows"), cols = model.get("columns");
      el.querySelector(".wb-count").textContent = `${rows.length} of ${model.get("total")} rows`;
      const sortCol = model.get("sort_column"), arrow = model.get("ascending") ? " ▲" : " ▼";
      const head = cols.map((c) => `<th data-col="${esc(c)}" style="cursor:pointer;text-align:left;border-bottom:1px solid #999">${esc(c)}${c === sortCol ? arrow : ""}</th>`).join("");
      const selected = model.get("selected");
      // A group whose rewards all tie teaches nothing (its advantages are 0): greyed, and said so on hover.
      const body = rows.map((r) =>
        `<tr data-index="${r._index}" class="${r.tied ? "wb-tied" : ""}" title="${r.tied ? "this group's rewards all tie: no gradient" + (r.dropped ? ` (dropped: ${esc(r.dropped)})` : "") : ""}"` +
        ` style="cursor:pointer;${r._index === selected ? "background:#dbeafe" : r.tied ? "color:#888;background:#f6f6f6" : ""}">` +
        cols.map((c) => `<td style="border-bottom:1px solid #eee;padding:2px 4px">${esc(r[c])}</td>`).join("") + "</tr>").join("");
      table.innerHTML = `<tr>${head}</tr>${body}`;
      el.querySelector(".wb-detail").innerHTML = model.get("tokens_html");  // built and escaped in Python
    };
    table.addEventListener("click", (e) => {
      const th = e.target.closest("th");
      if (th) {
        const col = th.dataset.col, same = col === model.get("sort_column");
        set(model, {sort_column: col, ascending: same ? !model.get("ascending") : true});
        return;
      }
      const tr = e.target.closest("tr[data-index]");
      if (tr) set(model, {selected: Number(tr.dataset.index)});
    });
    draw();
    const fields = ["rows", "columns", "sort_column", "ascending", "selected", "tokens_html", "query", "color_by", "error",
                    "total", "steps", "step", "history_prompt", "summary", "label"];
    for (const f of fields) model.on(`change:${f}`, draw);
    return () => { for (const f of fields) model.off(`change:${f}`, draw); };
  },
};
