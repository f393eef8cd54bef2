/**
 * How numbers read in the sidebar and the status bar. Pure functions, unit-tested.
 *
 * Costs of a small model are fractions of a cent, so a fixed two decimals would show $0.00 for a
 * whole training run: below a cent we keep three significant digits instead.
 */

import { BudgetState, IBudget, ILab, IRefusal, IRun, ISession, ITotals, Kind } from './types';

export function formatCost(cost: number, symbol = '$'): string {
  if (!Number.isFinite(cost) || cost <= 0) {
    return `${symbol}0.00`;
  }
  if (cost >= 1) {
    return `${symbol}${cost.toFixed(2)}`;
  }
  if (cost >= 0.01) {
    return `${symbol}${cost.toFixed(4)}`;
  }
  // 0.000123 -> "0.000123": three significant digits, never exponent notation.
  const digits = Math.min(20, 2 - Math.floor(Math.log10(cost)));
  return `${symbol}${cost.toFixed(digits)}`;
}

export function formatTokens(tokens: number): string {
  if (tokens < 1000) {
    return `${Math.round(tokens)}`;
  }
  if (tokens < 1_000_000) {
    return `${trim(tokens / 1000)}k`;
  }
  return `${trim(tokens / 1_000_000)}M`;
}

function trim(value: number): string {
  // 1.0 -> "1", 12.34 -> "12.3", 123.4 -> "123"
  return (value >= 100 ? value.toFixed(0) : value.toFixed(1)).replace(/\.0$/, '');
}

export function formatAge(seconds: number): string {
  const s = Math.max(0, Math.floor(seconds));
  if (s < 60) {
    return `${s}s`;
  }
  if (s < 3600) {
    return `${Math.floor(s / 60)}m ${s % 60}s`;
  }
  if (s < 86400) {
    return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  }
  return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
}

export function formatLoss(loss: number | null): string {
  if (loss === null || loss === undefined || !Number.isFinite(loss)) {
    return '–';
  }
  return Math.abs(loss) >= 100 ? loss.toFixed(1) : loss.toPrecision(4);
}

/** "SmolLM2-135M-Instruct" from "HuggingFaceTB/SmolLM2-135M-Instruct". */
export function shortModel(model: string | null): string {
  if (!model) {
    return 'no model yet';
  }
  return model.split('/').pop() || model;
}

/** "LoRA r8", or for rank 0 "full fine-tuning" (every weight trained); short: "r8" / "full". Empty with no rank. */
export function rankLabel(rank: number | null, short = false): string {
  if (rank === null) {
    return '';
  }
  if (rank === 0) {
    return short ? 'full' : 'full fine-tuning';
  }
  return short ? `r${rank}` : `LoRA r${rank}`;
}

/**
 * What a session is called: the name given to workbench.connect(name=...) (its user_metadata "name"), else
 * the notebook's name now (after a rename too), else the name it was given when it connected, else the id.
 */
export function sessionTitle(session: ISession): string {
  return (
    session.user_metadata?.name ||
    (session.notebook ? baseName(session.notebook) : null) ||
    session.display_name ||
    session.session_id
  );
}

/** "train:0" from "<session id>:train:0": a run's id within its session's row. */
export function runLabel(runId: string, sessionId: string): string {
  return runId.startsWith(`${sessionId}:`) ? runId.slice(sessionId.length + 1) : runId;
}

/** What a run is called: its user_metadata name (workbench.fork(..., name=)), else its short id. */
export function runName(run: IRun, sessionId: string): string {
  return run.user_metadata?.name || runLabel(run.training_run_id, sessionId);
}

/**
 * A session's runs as a tree: each run, then the forks made from it (in their order), each with its
 * depth. A run whose parent is not among them (another session's) is a root.
 */
export function runTree(runs: IRun[]): { run: IRun; depth: number }[] {
  const ids = new Set(runs.map(r => r.training_run_id));
  const children = new Map<string | null, IRun[]>();
  for (const run of runs) {
    const parent = run.parent_run_id;
    const key = parent && ids.has(parent) ? parent : null;
    children.set(key, [...(children.get(key) ?? []), run]);
  }
  const ordered: { run: IRun; depth: number }[] = [];
  const visit = (run: IRun, depth: number) => {
    ordered.push({ run, depth });
    for (const child of children.get(run.training_run_id) ?? []) {
      visit(child, depth + 1);
    }
  };
  for (const root of children.get(null) ?? []) {
    visit(root, 0);
  }
  return ordered;
}

/**
 * "6 steps", "6 steps (6 refused)" when the server refused the forward_backward before some optimizer steps,
 * "6 steps (1 skipped)" when some had no forward_backward sent before them, or both: "6 steps (2 refused, 1 skipped)".
 */
export function stepsText(run: IRun): string {
  const refused = run.refused_steps ?? 0;
  const skipped = run.skipped_steps ?? 0;
  const notes = [refused > 0 ? `${refused} refused` : '', skipped > 0 ? `${skipped} skipped` : ''].filter(Boolean);
  return plural(run.steps, 'step') + (notes.length ? ` (${notes.join(', ')})` : '');
}

/** What the refused and skipped steps are, a line each; empty without any. */
export function stepsTooltip(run: IRun): string {
  const lines: string[] = [];
  const refused = run.refused_steps ?? 0;
  if (refused > 0) {
    const last = run.last_refusal;
    lines.push(
      `${plural(refused, 'step')} refused: the server refused their forward_backward` +
        (last ? ` (${last.status} ${last.message})` : '') +
        ', so the optim_step after it had no gradient. ' +
        'Await each forward_backward (.result()) to see the error where it happens.'
    );
  }
  const skipped = run.skipped_steps ?? 0;
  if (skipped > 0) {
    lines.push(
      `${plural(skipped, 'step')} skipped: an optim_step with no forward_backward before it ` +
        '(an RL step whose groups all tied), so no loss'
    );
  }
  return lines.join('\n');
}

/** "6 requests refused · 402: tenant 'alice' budget of $0.0010 is spent ...": a session's refusals, the newest's words. */
export function refusalText(refusals: { count: number; last: IRefusal }): string {
  return `${plural(refusals.count, 'request')} refused · ${refusals.last.status}: ${refusals.last.message}`;
}

/** The refusals' tooltip: the newest in full, what it was and when. */
export function refusalTooltip(refusals: { count: number; last: IRefusal }): string {
  const last = refusals.last;
  return (
    `${plural(refusals.count, 'request')} of this session refused by the server; the newest, ` +
    `${last.request_type} at ${last.at.replace('T', ' ').slice(0, 19)}:\n${last.status} ${last.message}`
  );
}

/**
 * A run's last loss, saying what it is: "loss/token 0.0470" (the step's loss:sum over the tokens its loss
 * counts, as the notebooks print it), else "summed loss 25.79" (a custom loss, or a backend that does not
 * count the tokens); "at step 5" when that is not the run's last step (the steps after it were skipped, or
 * the next step's forward_backward came in before its optim_step). "no loss yet" before any.
 */
export function lossText(run: IRun): string {
  const perToken = run.loss_per_token;
  const step = run.loss_step;
  const at = step !== null && step !== undefined && step !== run.steps ? ` at step ${step}` : '';
  if (perToken !== null && perToken !== undefined && Number.isFinite(perToken)) {
    return `loss/token ${formatLoss(perToken)}${at}`;
  }
  if (run.last_loss !== null && run.last_loss !== undefined && Number.isFinite(run.last_loss)) {
    return `summed loss ${formatLoss(run.last_loss)}${at}`;
  }
  return 'no loss yet';
}

/** The loss's tooltip: both numbers and what they are. */
export function lossTooltip(run: IRun): string {
  const lines: string[] = [];
  if (run.loss_per_token !== null && run.loss_per_token !== undefined) {
    lines.push(
      `loss per token ${Number(run.loss_per_token.toPrecision(6))}: the step's loss:sum over the tokens its loss counts ` +
        '(the weights of cross_entropy; the tokens with an advantage of an RL loss)'
    );
  }
  if (run.last_loss !== null && run.last_loss !== undefined) {
    lines.push(`loss:sum ${Number(run.last_loss.toPrecision(6))}: the last forward_backward's loss, summed over its tokens`);
  }
  const steps = stepsTooltip(run);
  if (steps) {
    lines.push(steps);
  }
  return lines.join('\n');
}

/** "23:40 UTC" from an ISO time (the lab's start); empty without one. */
export function utcTime(iso: string): string {
  return /T\d\d:\d\d/.test(iso) ? `${iso.slice(11, 16)} UTC` : '';
}

/** One of the sidebar header's totals: what it covers, its amount (none for the count) and its tooltip. */
export interface IHeaderPart {
  name: string;
  label: string;
  amount: string;
  tooltip: string;
}

/**
 * The sidebar header's totals, each saying what it covers: the sessions listed and how many run, what the
 * running sessions have spent (ended ones not), and what every session created in this lab spent, ended
 * ones included (the lab's total never falls).
 */
export function headerParts(listed: number, running: ITotals, lab: ILab, symbol = '$'): IHeaderPart[] {
  const since = utcTime(lab.since);
  const when = lab.since ? lab.since.replace('T', ' ').slice(0, 16) + ' UTC' : 'the Jupyter server started';
  return [
    {
      name: 'count',
      label: `${plural(listed, 'session')} · ${running.sessions} running`,
      amount: '',
      tooltip: 'Sessions listed: those of every running backend, and those this lab remembers after they ended'
    },
    {
      name: 'running',
      label: 'running sessions',
      amount: formatCost(running.cost, symbol),
      tooltip:
        `What the ${plural(running.sessions, 'running session')} spent so far (ended sessions not counted): ` +
        `${formatTokens(totalTokens(running))} tokens`
    },
    {
      name: 'lab',
      label: `lab${since ? ` since ${since}` : ' total'}`,
      amount: formatCost(lab.cost, symbol),
      tooltip:
        `What every session created since ${when} spent, ended ones included: ` +
        `${plural(lab.sessions, 'session')}, ${formatTokens(totalTokens(lab))} tokens`
    }
  ];
}

/** Whether a session is still running (the others are drawn greyed, in their own group). */
export function isActive(session: ISession): boolean {
  return session.status === 'active';
}

/** Whether the session belongs to the notebook at `path`: by the notebook its kernel runs now, when the
 * lab knows it (so a rename is followed), else by the name it was given (a remote backend's). */
export function ofNotebook(session: ISession, path: string): boolean {
  return session.notebook ? session.notebook === path : session.display_name === baseName(path);
}

/** "3 steps" / "1 step". */
export function plural(n: number, word: string): string {
  return `${n} ${word}${n === 1 ? '' : 's'}`;
}

/** Tokens of every kind. */
export function totalTokens(totals: ITotals): number {
  return totals.prefill_tokens + totals.sample_tokens + totals.train_tokens;
}

/** The file name of a path: "00_quickstart.ipynb" from "notebooks/00_quickstart.ipynb". */
export function baseName(path: string): string {
  return path.split('/').pop() || path;
}

/** The running sessions of the notebook at `path` (see ofNotebook); none without a path. */
export function notebookSessions(sessions: ISession[], path: string | null): ISession[] {
  return path ? sessions.filter(s => isActive(s) && ofNotebook(s, path)) : [];
}

/**
 * The running sessions of the notebook at `path`, added up (see ofNotebook). Null when it has none.
 */
export function notebookTotals(sessions: ISession[], path: string | null): ITotals | null {
  const mine = notebookSessions(sessions, path);
  if (mine.length === 0) {
    return null;
  }
  const totals: ITotals = { sessions: mine.length, prefill_tokens: 0, sample_tokens: 0, train_tokens: 0, cost: 0 };
  for (const s of mine) {
    totals.prefill_tokens += s.prefill_tokens;
    totals.sample_tokens += s.sample_tokens;
    totals.train_tokens += s.train_tokens;
    totals.cost += s.cost;
  }
  return totals;
}

/**
 * The status item's text: the current notebook's running session (cost and tokens), then what the
 * whole lab spent; only the lab's total when the current tab has no running session.
 */
export function statusText(notebook: ITotals | null, lab: ILab, symbol = '$'): string {
  const spent = `lab ${formatCost(lab.cost, symbol)}`;
  if (!notebook) {
    return `Stepwise ${spent} · ${formatTokens(totalTokens(lab))} tok`;
  }
  // "notebook": the figure covers this notebook's running sessions only (the tooltip says so); "lab": every session.
  return `Stepwise notebook ${formatCost(notebook.cost, symbol)} · ${formatTokens(totalTokens(notebook))} tok · ${spent}`;
}

function kindsLine(totals: ITotals): string {
  const kinds: Kind[] = ['prefill', 'sample', 'train'];
  return kinds.map(kind => `${kind} ${formatTokens(totals[`${kind}_tokens`])}`).join(' · ') + ' tokens';
}

/** The status item's tooltip: the split by kind, for the notebook and for the lab. */
export function statusTooltip(name: string | null, notebook: ITotals | null, lab: ILab, symbol = '$'): string {
  const lines: string[] = [];
  if (name && notebook) {
    lines.push(`${name}: ${plural(notebook.sessions, 'running session')}, ${formatCost(notebook.cost, symbol)}`);
    lines.push(`  ${kindsLine(notebook)}`);
  } else if (name) {
    lines.push(`${name}: no running session (workbench.connect() in it starts one)`);
  }
  const since = lab.since ? lab.since.replace('T', ' ').slice(0, 16) + ' UTC' : 'the server started';
  lines.push(`This lab since ${since}: ${plural(lab.sessions, 'session')}, ${formatCost(lab.cost, symbol)}`);
  lines.push(`  ${kindsLine(lab)}`);
  return lines.join('\n');
}

const BUDGET_STATES: BudgetState[] = ['ok', 'warning', 'exhausted'];

/** The state's place in ok < warning < exhausted (an unknown state counts as ok). */
function severity(budget: IBudget): number {
  return Math.max(0, BUDGET_STATES.indexOf(budget.state));
}

/**
 * The budget nearest to refusing work among the running sessions of the notebook at `path`, their runs and
 * the tenant's (which refuses every session's work, so it counts for any notebook): the worst state, then the
 * largest fraction spent (workbench/client/connection.py tightest_budget).
 */
export function notebookBudget(
  sessions: ISession[],
  path: string | null,
  tenant: IBudget | null = null
): IBudget | null {
  const budgets: (IBudget | null | undefined)[] = [tenant];
  for (const session of notebookSessions(sessions, path)) {
    budgets.push(session.budget, ...session.runs.map(run => run.budget));
  }
  return tightestBudget(budgets);
}

/** The budget nearest to refusing work: the worst state, then the largest fraction spent; null without any. */
export function tightestBudget(budgets: (IBudget | null | undefined)[]): IBudget | null {
  let tightest: IBudget | null = null;
  for (const budget of budgets) {
    if (!budget) {
      continue;
    }
    if (
      !tightest ||
      severity(budget) > severity(tightest) ||
      (severity(budget) === severity(tightest) && budget.fraction > tightest.fraction)
    ) {
      tightest = budget;
    }
  }
  return tightest;
}

/**
 * What was spent of a budget: "$0.41 of $0.50 (82%)", "1,200 of 5,000 tokens (24%)", or both joined
 * by " · " (workbench/widgets/cost.py budget_text writes the same). Each amount of money keeps two
 * significant digits, and two decimals at least ("$0.41 of $0.50", "$0.000024 of $0.00010"): a small
 * model's steps cost fractions of a cent. The percentage is rounded down, so it never reads 80% before
 * the budget is in its warning state.
 */
export function budgetText(budget: IBudget, symbol = '$'): string {
  const money = (amount: number) =>
    `${symbol}${amount.toFixed(amount > 0 ? Math.min(20, Math.max(2, 1 - Math.floor(Math.log10(amount)))) : 2)}`;
  const parts: string[] = [];
  if (budget.budget_usd !== null && budget.budget_usd !== undefined) {
    parts.push(`${money(budget.spent_usd || 0)} of ${money(budget.budget_usd)}`);
  }
  if (budget.budget_tokens !== null && budget.budget_tokens !== undefined) {
    parts.push(`${(budget.spent_tokens || 0).toLocaleString('en-US')} of ${budget.budget_tokens.toLocaleString('en-US')} tokens`);
  }
  return `${parts.join(' · ')} (${Math.floor((budget.fraction || 0) * 100 + 1e-9)}%)`;
}

/** The tooltip's line for a budget: whose it is, what was spent, and what its state means. */
export function budgetLine(budget: IBudget, symbol = '$'): string {
  // A tenant's budget is the operator's to set (kernel_backend/api/budgets.py): set_budget cannot raise it.
  const tenant = budget.scope === 'tenant';
  const meaning: Record<string, string> = {
    ok: '',
    warning: ': nearly spent',
    exhausted: tenant
      ? ': exhausted, the backend refuses more work of every session of the tenant (the server operator raises it)'
      : ': exhausted, the backend refuses more work (workbench.set_budget(usd=...) raises it)'
  };
  const whose = tenant
    ? `The tenant's budget (tenant ${budget.target}, every session of it counts)`
    : `Budget of ${budget.scope} ${budget.target}`;
  return `${whose}: ${budgetText(budget, symbol)}${meaning[budget.state] ?? ''}`;
}
