/**
 * The sessions sidebar: one row per session of every running backend (called by the name given to
 * workbench.connect(name=...), else its notebook's), redrawn in place after each poll, under a header whose
 * totals each say what they cover; each row lists its training runs (steps, skipped ones counted, and the
 * last loss per token, or its sum said to be one), and a click on it shows its
 * checkpoints, each `tinker://` path with a copy button, and its in-memory sampler snapshots.
 * Sessions that ended (or whose backend stopped: the lab remembers them, with their checkpoints)
 * are greyed, in a group of their own that a click on its header folds. A session or run with a
 * budget shows it as a bar and "$0.41 of $0.50 (82%)", amber from 80% and red once exhausted; the tenant's
 * budget (which refuses the work of all its sessions) has its bar under the header. Refusals are shown where
 * they land: a run counts its steps whose forward_backward was refused ("6 steps (6 refused)"), and a session
 * the server refused requests of says so in red with the server's words, since an unawaited
 * forward_backward's error is otherwise seen nowhere.
 *
 * Rows are kept per session id and only their texts change between polls, so a click or a hover
 * is never lost to a redraw that replaced the element under the pointer.
 */

import { Clipboard } from '@jupyterlab/apputils';
import { Widget } from '@lumino/widgets';

import {
  budgetLine,
  budgetText,
  formatAge,
  formatCost,
  formatTokens,
  headerParts,
  IHeaderPart,
  isActive,
  lossText,
  lossTooltip,
  plural,
  refusalText,
  refusalTooltip,
  rankLabel,
  runLabel,
  runName,
  runTree,
  sessionTitle,
  shortModel,
  stepsText,
  stepsTooltip
} from './format';
import { stepwiseIcon } from './icon';
import { emptyLab, SessionsModel } from './model';
import { IBudget, ICheckpoint, IReport, IRun, ISession, ISnapshot } from './types';

export const SIDEBAR_ID = 'stepwise-sessions';

export class SessionsSidebar extends Widget {
  constructor(model: SessionsModel) {
    super();
    this._model = model;
    this.id = SIDEBAR_ID;
    this.addClass('jp-StepwiseSidebar');
    this.title.icon = stepwiseIcon;
    this.title.caption = 'Stepwise sessions';

    const header = el('div', 'jp-StepwiseSidebar-header');
    header.appendChild(el('h2', 'jp-StepwiseSidebar-title', 'Stepwise sessions'));
    header.appendChild(this._summary);
    header.appendChild(this._tenantBudget);
    this._endedHeader.type = 'button';
    this._endedHeader.addEventListener('click', () => model.toggle(ENDED_GROUP));
    this.node.append(header, this._message, this._backendErrors, this._list, this._endedHeader, this._endedList);
    model.changed.connect(this.render, this);
    this.render();
  }

  /** Shown before costs; from the settings. */
  get currencySymbol(): string {
    return this._symbol;
  }
  set currencySymbol(symbol: string) {
    this._symbol = symbol;
    this.render();
  }

  render(): void {
    const model = this._model;
    const report = model.report;
    const sessions = model.sessions;
    const running = model.running;
    if (report) {
      const parts = headerParts(sessions.length, running, report.lab ?? emptyLab(), this._symbol);
      drawHeader(this._summary, parts);
      this._summary.dataset.runningCost = String(running.cost);
      this._summary.dataset.labCost = String(report.lab?.cost ?? 0);
    } else {
      this._summary.textContent = 'Loading…';
    }
    drawBudget(this._tenantBudget, model.tenantBudget, this._symbol, 'tenant budget');

    const message = model.error ?? report?.message ?? emptyMessage(report);
    this._message.textContent = message ?? '';
    this._message.hidden = message === null;
    this._message.classList.toggle('jp-mod-error', model.error !== null);

    // The report's message already names every failure when no backend answered.
    const failed = report && !report.message ? report.backends.filter(b => b.error) : [];
    this._backendErrors.replaceChildren(
      ...failed.map(b => el('div', 'jp-StepwiseSidebar-backendError', b.error ?? ''))
    );

    // Active sessions in the first list, the others in the foldable "ended" group; both sorted.
    const seen = new Set<string>();
    const placed = new Map<HTMLElement, number>(); // list -> rows placed in it so far
    for (const session of sessions) {
      const key = `${session.backend} ${session.session_id}`;
      seen.add(key);
      let row = this._rows.get(key);
      if (!row) {
        row = new SessionRow(() => model.toggle(key));
        this._rows.set(key, row);
      }
      row.update(session, model.isExpanded(key), this._symbol);
      const list = isActive(session) ? this._list : this._endedList;
      const index = placed.get(list) ?? 0;
      placed.set(list, index + 1);
      const there = list.children[index] ?? null;
      if (there !== row.node) {
        list.insertBefore(row.node, there); // new, moved into sorted order, or into the other group
      }
    }
    for (const [key, row] of this._rows) {
      if (!seen.has(key)) {
        row.node.remove();
        this._rows.delete(key);
      }
    }
    const ended = placed.get(this._endedList) ?? 0;
    const folded = model.isExpanded(ENDED_GROUP); // the group starts open: a toggle folds it
    this._endedHeader.hidden = ended === 0;
    this._endedHeader.setAttribute('aria-expanded', String(!folded));
    setText(this._endedHeader, `${plural(ended, 'ended session')} · their checkpoints remain`);
    this._endedList.hidden = ended === 0 || folded;
  }

  dispose(): void {
    this._model.changed.disconnect(this.render, this);
    super.dispose();
  }

  private _model: SessionsModel;
  private _symbol = '$';
  private _summary = el('div', 'jp-StepwiseSidebar-summary');
  private _tenantBudget = el('div', 'jp-StepwiseBudget jp-StepwiseSidebar-tenantBudget');
  private _message = el('div', 'jp-StepwiseSidebar-message');
  private _backendErrors = el('div', 'jp-StepwiseSidebar-backendErrors');
  private _list = el('ul', 'jp-StepwiseSidebar-list');
  private _endedHeader = el('button', 'jp-StepwiseSidebar-endedHeader') as HTMLButtonElement;
  private _endedList = el('ul', 'jp-StepwiseSidebar-list jp-StepwiseSidebar-ended');
  private _rows = new Map<string, SessionRow>();
}

/** The model's expansion key of the "ended sessions" group (never a session's: those hold a space). */
const ENDED_GROUP = 'ended-group';

/** One session's <li>: a header button that expands it, its facts, its runs, and its checkpoints. */
class SessionRow {
  readonly node = el('li', 'jp-StepwiseSession');

  constructor(onToggle: () => void) {
    this._header.type = 'button';
    this._header.addEventListener('click', onToggle);
    this._header.append(this._title, this._status);
    this.node.append(this._header, this._facts, this._runs, this._tokens, this._budget, this._refusals, this._checkpoints);
  }

  update(session: ISession, expanded: boolean, symbol: string): void {
    const title = sessionTitle(session);
    const data = this.node.dataset;
    data.sessionId = session.session_id;
    data.status = session.status;
    data.runs = String(session.runs.length);
    data.cost = String(session.cost);
    data.name = title;
    data.notebook = session.notebook ?? '';
    data.prefillTokens = String(session.prefill_tokens);
    data.sampleTokens = String(session.sample_tokens);
    data.trainTokens = String(session.train_tokens);
    this.node.classList.toggle('jp-mod-ended', !isActive(session));
    this._header.setAttribute('aria-expanded', String(expanded));
    this._header.title = headerTooltip(session, title);
    setText(this._title, title);
    setText(this._status, session.status);
    this._status.className = `jp-StepwiseSession-status jp-mod-${session.status}`;

    const rank = rankLabel(session.lora_rank);
    setFacts(this._facts, [
      ['model', shortModel(session.base_model)],
      ['rank', rank],
      ['age', session.remembered ? '' : formatAge(session.age_s)], // a remembered age stopped when it was read
      ['worker', session.worker ? `on ${session.worker}` : '']
    ]);
    const runs = JSON.stringify([session.runs, symbol]);
    if (runs !== this._drawnRuns) {
      this._drawnRuns = runs;
      this._runs.replaceChildren(
        ...runTree(session.runs).map(({ run, depth }) => runItem(run, depth, session, symbol))
      );
    }
    setFacts(this._tokens, [
      ['prefill', `prefill ${formatTokens(session.prefill_tokens)}`],
      ['sample', `sample ${formatTokens(session.sample_tokens)}`],
      ['train', `train ${formatTokens(session.train_tokens)}`],
      ['cost', formatCost(session.cost, symbol)]
    ]);
    drawBudget(this._budget, session.budget, symbol);
    const refusals = session.refusals;
    this._refusals.hidden = !refusals;
    data.refusals = String(refusals?.count ?? 0);
    if (refusals) {
      setText(this._refusals, refusalText(refusals));
      this._refusals.title = refusalTooltip(refusals);
      this._refusals.dataset.status = String(refusals.last.status);
    }

    this._checkpoints.hidden = !expanded;
    const drawn = JSON.stringify([session.checkpoints, session.sampler_snapshots]);
    if (expanded && drawn !== this._drawnCheckpoints) {
      this._drawnCheckpoints = drawn;
      this._checkpoints.replaceChildren(
        ...checkpointItems(session.checkpoints, session.sampler_snapshots ?? [], session)
      );
    }
  }

  private _header = el('button', 'jp-StepwiseSession-header') as HTMLButtonElement;
  private _title = el('span', 'jp-StepwiseSession-title');
  private _status = el('span', 'jp-StepwiseSession-status');
  private _facts = el('div', 'jp-StepwiseSession-facts');
  private _runs = el('ul', 'jp-StepwiseSession-runs');
  private _tokens = el('div', 'jp-StepwiseSession-tokens');
  private _budget = el('div', 'jp-StepwiseBudget');
  private _refusals = el('div', 'jp-StepwiseRefusals');
  private _checkpoints = el('ul', 'jp-StepwiseSession-checkpoints');
  private _drawnRuns = '';
  private _drawnCheckpoints = '';
}

/** The header's tooltip: the session's id and backend, the name it started under, why it is greyed. */
function headerTooltip(session: ISession, title: string): string {
  const lines = [`${session.session_id} on ${session.backend}`];
  if (session.user_metadata?.name) {
    lines.push(`named by workbench.connect(name=...)${session.notebook ? `; its notebook is ${session.notebook}` : ''}`);
  } else if (session.display_name && session.display_name !== title) {
    lines.push(`started as ${session.display_name}; its notebook is now ${session.notebook}`);
  }
  if (session.status === 'ended') {
    lines.push('its backend stopped: the checkpoints below remain');
  } else if (session.status === 'unreachable') {
    lines.push('its backend does not answer (stopped?): the checkpoints below remain');
  }
  return lines.join('\n');
}

/**
 * One run: "train:0 · 12 steps · loss/token 0.0470" (or "6 steps (1 skipped) · loss/token 0.0470 at step 5"), with its model and rank when they differ from the session's.
 * A fork (workbench.fork) is indented under the run it branched from: "lr 3e-3 · from train:0 @ step 3 · ...".
 */
function runItem(run: IRun, depth: number, session: ISession, symbol: string): HTMLElement {
  const item = el('li', 'jp-StepwiseRun');
  item.dataset.runId = run.training_run_id;
  item.dataset.steps = String(run.steps);
  item.dataset.depth = String(depth);
  item.style.paddingLeft = `${depth * 14}px`;
  item.title = run.training_run_id;
  const parent = run.parent_run_id;
  const parentRun = session.runs.find(r => r.training_run_id === parent);
  const other =
    run.base_model !== session.base_model || run.lora_rank !== session.lora_rank
      ? `${shortModel(run.base_model)} ${rankLabel(run.lora_rank, true)}`
      : '';
  item.append(el('span', 'jp-StepwiseRun-name', runName(run, session.session_id)));
  if (parent) {
    const from = parentRun ? runName(parentRun, session.session_id) : parent;
    item.dataset.parent = parent;
    item.append(el('span', 'jp-StepwiseRun-fork', `from ${from} @ step ${run.fork_step ?? '?'}`));
  }
  const loss = el('span', 'jp-StepwiseRun-loss', lossText(run));
  loss.title = lossTooltip(run);
  item.dataset.skipped = String(run.skipped_steps ?? 0);
  item.dataset.refused = String(run.refused_steps ?? 0);
  const steps = el('span', 'jp-StepwiseRun-steps', stepsText(run));
  steps.title = stepsTooltip(run);
  steps.classList.toggle('jp-mod-refused', (run.refused_steps ?? 0) > 0);
  item.append(steps, loss);
  if (other) {
    item.append(el('span', 'jp-StepwiseRun-model', other));
  }
  if (run.budget) {
    const budget = el('div', 'jp-StepwiseBudget');
    drawBudget(budget, run.budget, symbol);
    item.append(budget);
  }
  return item;
}

/**
 * A budget as a bar and its text ("$0.41 of $0.50 (82%)", after `label` when given), drawn into `node` in
 * place; hidden without one. Its class says its state (stepwise-budget-ok / -warning / -exhausted: the
 * colours, as the status bar's), its data the exact figures, its tooltip whose budget it is and what the
 * state means.
 */
function drawBudget(node: HTMLElement, budget: IBudget | null | undefined, symbol: string, label = ''): void {
  node.hidden = !budget;
  if (!budget) {
    return;
  }
  if (node.childElementCount !== 2) {
    const track = el('div', 'jp-StepwiseBudget-track');
    track.append(el('div', 'jp-StepwiseBudget-bar'));
    node.replaceChildren(track, el('span', 'jp-StepwiseBudget-text'));
  }
  for (const state of ['ok', 'warning', 'exhausted']) {
    node.classList.toggle(`stepwise-budget-${state}`, budget.state === state);
  }
  node.dataset.state = budget.state;
  node.dataset.fraction = String(budget.fraction);
  node.dataset.scope = budget.scope;
  node.title = budgetLine(budget, symbol);
  const bar = node.querySelector('.jp-StepwiseBudget-bar') as HTMLElement;
  bar.style.width = `${Math.max(0, Math.min(1, budget.fraction || 0)) * 100}%`;
  setText(
    node.querySelector('.jp-StepwiseBudget-text') as HTMLElement,
    (label ? `${label} ` : '') + budgetText(budget, symbol)
  );
}

/**
 * The header's totals, drawn into `node` in place: one line each, <span class="jp-StepwiseSidebar-<name>">
 * holding what it covers and its amount (right-aligned), with its tooltip.
 */
function drawHeader(node: HTMLElement, parts: IHeaderPart[]): void {
  if (node.childElementCount !== parts.length) {
    node.replaceChildren(
      ...parts.map(part => {
        const line = el('span', `jp-StepwiseSidebar-${part.name}`);
        line.append(el('span', 'jp-StepwiseSidebar-label'), ' ', el('span', 'jp-StepwiseSidebar-amount'));
        return line;
      })
    );
  }
  parts.forEach((part, i) => {
    const line = node.children[i] as HTMLElement;
    line.title = part.tooltip;
    setText(line.querySelector('.jp-StepwiseSidebar-label') as HTMLElement, part.label);
    setText(line.querySelector('.jp-StepwiseSidebar-amount') as HTMLElement, part.amount);
  });
}

/** What to say when the backends answered but have no session yet. */
function emptyMessage(report: IReport | null): string | null {
  if (!report || report.message || report.sessions.length > 0) {
    return null;
  }
  const backends = plural(report.backends.length, 'backend');
  return `No sessions yet on ${backends}: service.create_lora_training_client(...) starts one.`;
}

function checkpointItems(checkpoints: ICheckpoint[], snapshots: ISnapshot[], session: ISession): HTMLElement[] {
  if (checkpoints.length === 0 && snapshots.length === 0) {
    return [
      el(
        'li',
        'jp-StepwiseCheckpoint-none',
        'No checkpoints yet: save_state() or save_weights_for_sampler() makes one.'
      )
    ];
  }
  const saved = checkpoints.map(checkpoint => {
    const item = el('li', 'jp-StepwiseCheckpoint');
    item.dataset.type = checkpoint.checkpoint_type;
    const path = el('code', 'jp-StepwiseCheckpoint-path', checkpoint.tinker_path);
    const kind = el(
      'span',
      'jp-StepwiseCheckpoint-type',
      `${CHECKPOINT_KINDS[checkpoint.checkpoint_type] ?? checkpoint.checkpoint_type} · ` +
        `${runLabel(checkpoint.training_run_id, session.session_id)} · ${when(checkpoint.time)}`
    );
    const copy = el('button', 'jp-StepwiseCheckpoint-copy jp-Button', 'Copy') as HTMLButtonElement;
    copy.type = 'button';
    copy.title = `Copy ${checkpoint.tinker_path}`;
    copy.addEventListener('click', () => {
      Clipboard.copyToSystem(checkpoint.tinker_path);
      copy.textContent = 'Copied';
      setTimeout(() => (copy.textContent = 'Copy'), 1500);
    });
    item.append(path, copy, kind);
    return item;
  });
  // No path to copy: say what they are, and how to make one that lasts.
  const inMemory = snapshots.map(snapshot => {
    const item = el('li', 'jp-StepwiseSnapshot');
    item.dataset.samplerId = snapshot.sampler_id;
    item.append(
      el('code', 'jp-StepwiseSnapshot-id', snapshot.sampler_id),
      el(
        'span',
        'jp-StepwiseCheckpoint-type',
        `in-memory sampler snapshot · ${runLabel(snapshot.training_run_id, session.session_id)} · ` +
          `${when(snapshot.time)} · no tinker:// path (save_weights_for_sampler(name) saves one)`
      )
    );
    return item;
  });
  return [...saved, ...inMemory];
}

/** What each kind of checkpoint holds, in words. */
const CHECKPOINT_KINDS: Record<string, string> = {
  training: 'state (weights + optimizer)',
  sampler: 'sampler weights',
  external: 'external weights (for download)'
};

function when(time: string): string {
  return time.replace('T', ' ').slice(0, 19);
}

function el(tag: string, className: string, text?: string): HTMLElement {
  const node = document.createElement(tag);
  node.className = className;
  if (text !== undefined) {
    node.textContent = text;
  }
  return node;
}

function setText(node: HTMLElement, text: string): void {
  if (node.textContent !== text) {
    node.textContent = text;
  }
}

/** Keep one <span class="jp-StepwiseSession-<name>"> per fact, in order; empty facts are hidden. */
function setFacts(node: HTMLElement, facts: [string, string][]): void {
  if (node.childElementCount !== facts.length) {
    node.replaceChildren(
      ...facts.map(([name]) => el('span', `jp-StepwiseSession-${name}`))
    );
  }
  facts.forEach(([, text], i) => {
    const span = node.children[i] as HTMLElement;
    setText(span, text);
    span.hidden = text === '';
  });
}
