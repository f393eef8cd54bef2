/**
 * The status-bar cost meter: the current notebook's running session (cost and tokens), then what
 * the whole lab spent since the Jupyter server started; the tooltip splits prefill / sample / train.
 * It reads the shared model, which polls the Jupyter server rather than a kernel, so it moves while
 * a training cell is still running. When the notebook's session, one of its runs or the tenant has a budget,
 * the tightest of them turns the item amber from 80% spent (class stepwise-budget-warning) and red once the
 * backend refuses more work (stepwise-budget-exhausted); the tooltip names the budget (a tenant's says so).
 */

import { Widget } from '@lumino/widgets';

import { baseName, budgetLine, notebookBudget, notebookTotals, statusText, statusTooltip } from './format';
import { emptyLab, SessionsModel } from './model';

export class CostStatus extends Widget {
  constructor(model: SessionsModel) {
    super();
    this._model = model;
    this.addClass('jp-StepwiseCost');
    model.changed.connect(this.render, this);
    this.render();
  }

  get currencySymbol(): string {
    return this._symbol;
  }
  set currencySymbol(symbol: string) {
    this._symbol = symbol;
    this.render();
  }

  /** The path of the notebook in the current tab, or null (the plugin follows the shell). */
  get notebookPath(): string | null {
    return this._path;
  }
  set notebookPath(path: string | null) {
    this._path = path;
    this.render();
  }

  render(): void {
    const lab = this._model.report?.lab ?? emptyLab();
    const notebook = notebookTotals(this._model.sessions, this._path);
    const name = this._path ? baseName(this._path) : null;
    this.node.textContent = statusText(notebook, lab, this._symbol);
    const budget = notebookBudget(this._model.sessions, this._path, this._model.tenantBudget);
    this.node.title = this._model.error
      ? `Stepwise: ${this._model.error}`
      : (budget ? budgetLine(budget, this._symbol) + '\n' : '') + statusTooltip(name, notebook, lab, this._symbol);
    this.node.classList.toggle('stepwise-budget-warning', budget?.state === 'warning');
    this.node.classList.toggle('stepwise-budget-exhausted', budget?.state === 'exhausted');
    // The exact figures, for tests and for anyone inspecting the page.
    const data = this.node.dataset;
    data.notebook = notebook && name ? name : '';
    data.cost = String(notebook?.cost ?? 0);
    data.prefillTokens = String(notebook?.prefill_tokens ?? 0);
    data.sampleTokens = String(notebook?.sample_tokens ?? 0);
    data.trainTokens = String(notebook?.train_tokens ?? 0);
    data.labCost = String(lab.cost);
    data.labSessions = String(lab.sessions);
    data.budgetState = budget?.state ?? '';
    data.budgetFraction = budget ? String(budget.fraction) : '';
  }

  dispose(): void {
    this._model.changed.disconnect(this.render, this);
    super.dispose();
  }

  private _model: SessionsModel;
  private _symbol = '$';
  private _path: string | null = null;
}
