// The rollout inspector's front end: a filter box, a sortable table, and the selected
// completion's tokens. All state lives in Python traitlets; this file only draws them and
// writes back what the user did (query, sort_column/ascending, selected, color_by).
const esc = (s) => String(s ?? "").replace(/[&<>"]/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]));

function set(model, changes) {
  for (const [k, v] of Object.entries(changes)) model.set(k, v);
  model.save_changes();
}

export default {
  render({ model, el }) {
    el.classList.add("wb-rollouts");
    el.innerHTML = `
      <div style="display:flex;gap:8px;align-items:center;font:12px sans-serif;margin-bottom:4px">
        <input class="wb-query" placeholder="filter, e.g. reward > 0 and advantage < 0" style="flex:1">
        <label>colour by <select class="wb-color"><option>logprob</option><option>advantage</option></select></label>
        <span class="wb-count"></span>
      </div>
      <div class="wb-error" style="color:#b00;font:12px sans-serif"></div>
      <div style="max-height:320px;overflow:auto"><table class="wb-table" style="border-collapse:collapse;font:12px sans-serif;width:100%"></table></div>
      <div class="wb-detail" style="margin-top:6px"></div>`;
    const query = el.querySelector(".wb-query"), color = el.querySelector(".wb-color");
    const table = el.querySelector(".wb-table");
    query.addEventListener("keydown", (e) => { e.stopPropagation(); if (e.key === "Enter") set(model, {query: query.value}); });
    color.addEventListener("change", () => set(model, {color_by: color.value}));

    const draw = () => {
      query.value = model.get("query");
      color.value = model.get("color_by");
      el.querySelector(".wb-error").textContent = model.get("error");
      const rows = model.get("rows"), cols = model.get("columns");
      el.querySelector(".wb-count").textContent = `${rows.length} of ${model.get("total")} rows`;
      const sortCol = model.get("sort_column"), arrow = model.get("ascending") ? " ▲" : " ▼";
      const head = cols.map((c) => `<th data-col="${esc(c)}" style="cursor:pointer;text-align:left;border-bottom:1px solid #999">${esc(c)}${c === sortCol ? arrow : ""}</th>`).join("");
      const selected = model.get("selected");
      const body = rows.map((r) =>
        `<tr data-index="${r._index}" style="cursor:pointer;${r._index === selected ? "background:#dbeafe" : ""}">` +
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
    const fields = ["rows", "columns", "sort_column", "ascending", "selected", "tokens_html", "query", "color_by", "error", "total"];
    for (const f of fields) model.on(`change:${f}`, draw);
    return () => { for (const f of fields) model.off(`change:${f}`, draw); };
  },
};
