/**
 * The status-bar cost meter: cost and tokens of the running sessions of every backend, with the
 * prefill / sample / train split in its tooltip. It reads the shared model, which polls the Jupyter
 * server rather than a kernel, so it moves while a training cell is still running.
 */

import { Widget } from '@lumino/widgets';

import { statusText, statusTooltip } from './format';
import { SessionsModel } from './model';

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

  render(): void {
    const running = this._model.running;
    this.node.textContent = statusText(running, this._symbol);
    this.node.title = this._model.error
      ? `Stepwise: ${this._model.error}`
      : statusTooltip(running, this._symbol);
    // The exact figures, for tests and for anyone inspecting the page.
    this.node.dataset.cost = String(running.cost);
    this.node.dataset.sessions = String(running.sessions);
  }

  dispose(): void {
    this._model.changed.disconnect(this.render, this);
    super.dispose();
  }

  private _model: SessionsModel;
  private _symbol = '$';
}
