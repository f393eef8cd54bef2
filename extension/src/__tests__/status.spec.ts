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

  it("turns red when the tenant's budget is exhausted, its tooltip saying the budget is the tenant's (issue 65)", async () => {
    const tenant = { scope: 'tenant', target: 'alice', budget_usd: 0.001, budget_tokens: null, spent_usd: 0.0012,
      spent_tokens: 0, pending_usd: 0, fraction: 1.2, state: 'exhausted' as const };
    const answers = [{ ...report('ok'), budget: tenant }, { ...report('warning'), budget: { ...tenant, fraction: 0.5, state: 'ok' as const } }];
    const model = new SessionsModel({ fetch: async () => answers.shift()! });
    const status = new CostStatus(model);
    status.notebookPath = 'work/nb.ipynb';
    await model.update(); // the session's budget is fine, the tenant's spent: the tenant's wins
    expect(status.node.classList.contains('stepwise-budget-exhausted')).toBe(true);
    expect(status.node.dataset.budgetState).toBe('exhausted');
    expect(status.node.title.split('\n')[0]).toMatch(/^The tenant's budget \(tenant alice, every session of it counts\): /);
    status.notebookPath = 'another.ipynb'; // the tenant's budget refuses every notebook's work
    expect(status.node.classList.contains('stepwise-budget-exhausted')).toBe(true);
    status.notebookPath = 'work/nb.ipynb';
    await model.update(); // the session's 80% is now the tightest
    expect(status.node.classList.contains('stepwise-budget-exhausted')).toBe(false);
    expect(status.node.classList.contains('stepwise-budget-warning')).toBe(true);
    expect(status.node.title.split('\n')[0]).toMatch(/^Budget of session s1: /);
    model.dispose();
  });
});
