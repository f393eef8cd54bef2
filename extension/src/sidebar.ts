/**
 * The sessions sidebar: one row per session of every running backend, redrawn in place after each
 * poll. A click on a row shows its checkpoints, each `tinker://` path with a copy button.
 *
 * Rows are kept per session id and only their texts change between polls, so a click or a hover
 * is never lost to a redraw that replaced the element under the pointer.
 */

import { Clipboard } from '@jupyterlab/apputils';
import { Widget } from '@lumino/widgets';

import {
  formatAge,
  formatCost,
  formatLoss,
  formatTokens,
  plural,
  sessionTitle,
  shortModel
} from './format';
import { stepwiseIcon } from './icon';
import { SessionsModel } from './model';
import { ICheckpoint, IReport, ISession } from './types';

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
    this.node.append(header, this._message, this._backendErrors, this._list);
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
    this._summary.textContent = report
      ? `${plural(sessions.length, 'session')} · ${running.sessions} running · ${formatCost(running.cost, this._symbol)}` +
        ` · lab ${formatCost(report.lab?.cost ?? 0, this._symbol)}`
      : 'Loading…';

    const message = model.error ?? report?.message ?? emptyMessage(report);
    this._message.textContent = message ?? '';
    this._message.hidden = message === null;
    this._message.classList.toggle('jp-mod-error', model.error !== null);

    // The report's message already names every failure when no backend answered.
    const failed = report && !report.message ? report.backends.filter(b => b.error) : [];
    this._backendErrors.replaceChildren(
      ...failed.map(b => el('div', 'jp-StepwiseSidebar-backendError', b.error ?? ''))
    );

    const seen = new Set<string>();
    sessions.forEach((session, index) => {
      const key = `${session.backend} ${session.session_id}`;
      seen.add(key);
      let row = this._rows.get(key);
      if (!row) {
        row = new SessionRow(() => model.toggle(key));
        this._rows.set(key, row);
      }
      row.update(session, model.isExpanded(key), this._symbol);
      const there = this._list.children[index] ?? null;
      if (there !== row.node) {
        this._list.insertBefore(row.node, there); // new, or moved into sorted order
      }
    });
    for (const [key, row] of this._rows) {
      if (!seen.has(key)) {
        row.node.remove();
        this._rows.delete(key);
      }
    }
  }

  dispose(): void {
    this._model.changed.disconnect(this.render, this);
    super.dispose();
  }

  private _model: SessionsModel;
  private _symbol = '$';
  private _summary = el('div', 'jp-StepwiseSidebar-summary');
  private _message = el('div', 'jp-StepwiseSidebar-message');
  private _backendErrors = el('div', 'jp-StepwiseSidebar-backendErrors');
  private _list = el('ul', 'jp-StepwiseSidebar-list');
  private _rows = new Map<string, SessionRow>();
}

/** One session's <li>: a header button that expands it, its facts, and its checkpoints. */
class SessionRow {
  readonly node = el('li', 'jp-StepwiseSession');

  constructor(onToggle: () => void) {
    this._header.type = 'button';
    this._header.addEventListener('click', onToggle);
    this._header.append(this._title, this._status);
    this.node.append(this._header, this._facts, this._tokens, this._checkpoints);
  }

  update(session: ISession, expanded: boolean, symbol: string): void {
    this.node.dataset.sessionId = session.session_id;
    this.node.dataset.status = session.status;
    this.node.dataset.steps = String(session.steps);
    this.node.dataset.cost = String(session.cost);
    this.node.dataset.name = session.display_name ?? '';
    this.node.dataset.prefillTokens = String(session.prefill_tokens);
    this.node.dataset.sampleTokens = String(session.sample_tokens);
    this.node.dataset.trainTokens = String(session.train_tokens);
    this._header.setAttribute('aria-expanded', String(expanded));
    this._header.title = `${session.session_id} on ${session.backend}`;
    setText(this._title, sessionTitle(session));
    setText(this._status, session.status);
    this._status.className = `jp-StepwiseSession-status jp-mod-${session.status}`;

    const rank = session.lora_rank === null ? '' : `LoRA r${session.lora_rank}`;
    setFacts(this._facts, [
      ['model', shortModel(session.base_model)],
      ['rank', rank],
      ['steps', plural(session.steps, 'step')],
      ['loss', `loss ${formatLoss(session.last_loss)}`],
      ['age', formatAge(session.age_s)],
      ['worker', session.worker ? `on ${session.worker}` : '']
    ]);
    setFacts(this._tokens, [
      ['prefill', `prefill ${formatTokens(session.prefill_tokens)}`],
      ['sample', `sample ${formatTokens(session.sample_tokens)}`],
      ['train', `train ${formatTokens(session.train_tokens)}`],
      ['cost', formatCost(session.cost, symbol)]
    ]);

    this._checkpoints.hidden = !expanded;
    const drawn = JSON.stringify(session.checkpoints);
    if (expanded && drawn !== this._drawnCheckpoints) {
      this._drawnCheckpoints = drawn;
      this._checkpoints.replaceChildren(...checkpointItems(session.checkpoints));
    }
  }

  private _header = el('button', 'jp-StepwiseSession-header') as HTMLButtonElement;
  private _title = el('span', 'jp-StepwiseSession-title');
  private _status = el('span', 'jp-StepwiseSession-status');
  private _facts = el('div', 'jp-StepwiseSession-facts');
  private _tokens = el('div', 'jp-StepwiseSession-tokens');
  private _checkpoints = el('ul', 'jp-StepwiseSession-checkpoints');
  private _drawnCheckpoints = '';
}

/** What to say when the backends answered but have no session yet. */
function emptyMessage(report: IReport | null): string | null {
  if (!report || report.message || report.sessions.length > 0) {
    return null;
  }
  const backends = plural(report.backends.length, 'backend');
  return `No sessions yet on ${backends}: service.create_lora_training_client(...) starts one.`;
}

function checkpointItems(checkpoints: ICheckpoint[]): HTMLElement[] {
  if (checkpoints.length === 0) {
    return [
      el(
        'li',
        'jp-StepwiseCheckpoint-none',
        'No checkpoints yet: save_state() or save_weights_for_sampler() makes one.'
      )
    ];
  }
  return checkpoints.map(checkpoint => {
    const item = el('li', 'jp-StepwiseCheckpoint');
    const path = el('code', 'jp-StepwiseCheckpoint-path', checkpoint.tinker_path);
    const kind = el(
      'span',
      'jp-StepwiseCheckpoint-type',
      `${checkpoint.checkpoint_type} · ${checkpoint.time.replace('T', ' ').slice(0, 19)}`
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
