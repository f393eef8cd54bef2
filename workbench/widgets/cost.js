// The cost meter's front end (workbench/widgets/cost.py, CostMeter): the table of tokens and money, and the budget bar
// with its state's colour. Python formats every number (the `rows` and `budget_text` traits); this file only draws.
const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]));
const FIELDS = ["scope", "rows", "error", "budget", "budget_text", "refused_text"];
// JupyterLab's theme colours (the extension's status bar and sidebar use the same), with fallbacks elsewhere.
const BUDGET_COLOURS = {ok: "var(--jp-brand-color1, #1976d2)", warning: "var(--jp-warn-color1, #f57c00)",
                        exhausted: "var(--jp-error-color1, #d32f2f)"};

const budgetHtml = (budget, text) => {
  if (!budget || !budget.state) return "";
  const state = BUDGET_COLOURS[budget.state] ? budget.state : "ok";
  const width = Math.max(0, Math.min(1, Number(budget.fraction) || 0)) * 100;
  const note = state === "exhausted"
    ? `<div class="wb-budget-note">Budget exhausted: the backend refuses more work. workbench.set_budget(usd=...) raises it.</div>`
    : "";
  return `<div class="wb-budget wb-budget-${state}" data-state="${state}" data-fraction="${esc(budget.fraction)}"` +
    ` style="margin-top:6px">` +
    `<div>Budget · ${esc(budget.scope)} ${esc(budget.target)}: <span class="wb-budget-text" style="color:` +
    `${state === "ok" ? "inherit" : BUDGET_COLOURS[state]};font-weight:${state === "ok" ? "normal" : "bold"}">` +
    `${esc(text)}</span></div>` +
    `<div class="wb-budget-track" style="width:260px;height:8px;border-radius:4px;margin-top:2px;` +
    `background:var(--jp-layout-color3, #ddd);overflow:hidden">` +
    `<div class="wb-budget-bar" style="width:${width}%;height:100%;background:${BUDGET_COLOURS[state]}"></div></div>` +
    note + `</div>`;
};

export default {
  render({ model, el }) {
    el.classList.add("wb-cost");
    const draw = () => {
      const rows = model.get("rows") || [];
      const error = model.get("error");
      const cell = (text, cls) => `<td class="${cls}" style="padding:2px 10px;text-align:right">${esc(text)}</td>`;
      el.innerHTML =
        `<div style="font:12px sans-serif"><b>Cost · ${esc(model.get("scope"))}</b>` +
        `<table style="border-collapse:collapse">` +
        `<tr><th></th><th style="padding:2px 10px;text-align:right">tokens</th>` +
        `<th style="padding:2px 10px;text-align:right">cost</th></tr>` +
        rows.map(([label, tokens, cost]) =>
          `<tr data-kind="${esc(label)}"><td style="padding:2px 10px 2px 0">${label === "total" ? "<b>total</b>" : esc(label)}</td>` +
          cell(tokens, "wb-cost-tokens") + cell(cost, "wb-cost-cost") + `</tr>`).join("") +
        `</table>` + budgetHtml(model.get("budget"), model.get("budget_text")) +
        // Refused requests bill nothing, so the table above never shows them: said here, in red, in the server's words.
        (model.get("refused_text") ? `<div class="wb-refusals" style="color:${BUDGET_COLOURS.exhausted};` +
          `margin-top:6px;max-width:520px">${esc(model.get("refused_text"))}</div>` : "") +
        (error ? `<div class="wb-cost-error" style="color:#b00">${esc(error)}</div>` : "") + `</div>`;
    };
    draw();
    for (const f of FIELDS) model.on(`change:${f}`, draw);
    return () => { for (const f of FIELDS) model.off(`change:${f}`, draw); };
  },
};
