/**
 * @jest-environment jsdom
 */
// The status item drawn from a model in a DOM: its text, and its colour class and tooltip when the
// current notebook's session has a budget.

import './jsdom-shims';

import { emptyLab, emptyRunning, SessionsModel } from '../model';
import { CostStatus } from '../status';
import { BudgetState, IReport, ISession } from '../types';

const FRACTION: Record<BudgetState, number> = { ok: 0.5, warning: 0.8, exhausted: 1 };

function report(state: BudgetState | null): IReport {
  const session: ISession = {
    session_id: 's1', status: 'active', created_at: '2026-01-01T00:00:00Z', age_s: 5, display_name: 'nb.ipynb',
    base_model: null, lora_rank: null, training_run_ids: [], runs: [], prefill_tokens: 0, sample_tokens: 0,
    train_tokens: 1000, cost: 0.00004, checkpoints: [], sampler_snapshots: [], backend: 'http://127.0.0.1:1',
    budget: state && { scope: 'session', target: 's1', budget_usd: 0.00005, budget_tokens: null,
                       spent_usd: 0.00005 * FRACTION[state], spent_tokens: 1000, pending_usd: 0, fraction: FRACTION[state], state }
  };
  return { sessions: [session], running: emptyRunning(), lab: emptyLab(), backends: [], currency: 'USD',
           runtime_dir: '/tmp', message: null };
}

describe('CostStatus', () => {
  it("turns amber from 80% of the notebook's budget and red when exhausted, its tooltip naming the budget", async () => {
    const answers = [report(null), report('ok'), report('warning'), report('exhausted')];
    const model = new SessionsModel({ fetch: async () => answers.shift()! });
    const status = new CostStatus(model);
    status.notebookPath = 'work/nb.ipynb';
    const classes = () => ['warning', 'exhausted'].filter(s => status.node.classList.contains(`stepwise-budget-${s}`));

    await model.update();
    expect(classes()).toEqual([]);
    expect(status.node.dataset.budgetState).toBe('');
    await model.update();
    expect(classes()).toEqual([]);
    expect(status.node.title.split('\n')[0]).toBe('Budget of session s1: $0.000025 of $0.000050 (50%)');
    await model.update();
    expect(classes()).toEqual(['warning']);
    expect(status.node.dataset.budgetState).toBe('warning');
    expect(status.node.title.split('\n')[0]).toBe('Budget of session s1: $0.000040 of $0.000050 (80%): nearly spent');
    await model.update();
    expect(classes()).toEqual(['exhausted']);
    expect(status.node.title).toContain('exhausted, the backend refuses more work');
    expect(status.node.textContent).toMatch(/^Stepwise notebook \$0\.0000400 · 1k tok/);

    status.notebookPath = 'another.ipynb'; // another tab: not this budget's notebook
    expect(classes()).toEqual([]);
    model.dispose();
  });
});
