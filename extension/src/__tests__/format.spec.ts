import {
  budgetLine,
  budgetText,
  formatAge,
  formatCost,
  formatLoss,
  formatTokens,
  lossText,
  lossTooltip,
  plural,
  refusalText,
  refusalTooltip,
  shortModel,
  notebookBudget,
  notebookTotals,
  runLabel,
  sessionTitle,
  statusText,
  statusTooltip,
  stepsText,
  stepsTooltip,
  totalTokens,
  utcTime
} from '../format';
import { IBudget, ILab, ISession } from '../types';

describe('formatCost', () => {
  it('keeps three significant digits below a cent', () => {
    expect(formatCost(0.000123456)).toBe('$0.000123');
    expect(formatCost(0.00999)).toBe('$0.00999');
    expect(formatCost(1.5e-9)).toBe('$0.00000000150');
  });
  it('uses four decimals up to a dollar and two above', () => {
    expect(formatCost(0.0123456)).toBe('$0.0123');
    expect(formatCost(12.345)).toBe('$12.35');
  });
  it('shows zero, negative and non-numbers as zero', () => {
    expect(formatCost(0)).toBe('$0.00');
    expect(formatCost(-1)).toBe('$0.00');
    expect(formatCost(NaN)).toBe('$0.00');
  });
  it('takes the currency symbol', () => {
    expect(formatCost(2, '€')).toBe('€2.00');
  });
});

describe('formatTokens', () => {
  it('abbreviates thousands and millions', () => {
    expect(formatTokens(0)).toBe('0');
    expect(formatTokens(999)).toBe('999');
    expect(formatTokens(1000)).toBe('1k');
    expect(formatTokens(12345)).toBe('12.3k');
    expect(formatTokens(123456)).toBe('123k');
    expect(formatTokens(2_500_000)).toBe('2.5M');
  });
});

describe('formatAge', () => {
  it('reads as seconds, minutes, hours, days', () => {
    expect(formatAge(-3)).toBe('0s');
    expect(formatAge(42.9)).toBe('42s');
    expect(formatAge(192)).toBe('3m 12s');
    expect(formatAge(3 * 3600 + 5 * 60)).toBe('3h 5m');
    expect(formatAge(2 * 86400 + 3 * 3600)).toBe('2d 3h');
  });
});

describe('small labels', () => {
  it('formats a loss, or a dash when there is none', () => {
    expect(formatLoss(null)).toBe('–');
    expect(formatLoss(12.3456)).toBe('12.35');
    expect(formatLoss(1234.56)).toBe('1234.6');
  });
  it('shortens a hub model id and pluralises', () => {
    expect(shortModel('HuggingFaceTB/SmolLM2-135M-Instruct')).toBe('SmolLM2-135M-Instruct');
    expect(shortModel(null)).toBe('no model yet');
    expect(plural(1, 'step')).toBe('1 step');
    expect(plural(3, 'step')).toBe('3 steps');
  });
});

describe('status item', () => {
  const sessions: ISession[] = [
    { session_id: 'a', status: 'active', created_at: '2026-01-01T00:00:00Z', age_s: 5,
      display_name: '00_quickstart.ipynb', base_model: null, lora_rank: null, training_run_ids: [], runs: [],
      prefill_tokens: 100, sample_tokens: 50, train_tokens: 1850, cost: 0.000456,
      checkpoints: [], sampler_snapshots: [], backend: 'http://127.0.0.1:1' },
    { session_id: 'b', status: 'finished', created_at: '2026-01-01T00:00:00Z', age_s: 5,
      display_name: '00_quickstart.ipynb', base_model: null, lora_rank: null, training_run_ids: [], runs: [],
      prefill_tokens: 9, sample_tokens: 9, train_tokens: 9, cost: 0.9,
      checkpoints: [], sampler_snapshots: [], backend: 'http://127.0.0.1:1' }
  ];
  const lab: ILab = { since: '2026-01-01T09:30:00+00:00', sessions: 4, prefill_tokens: 1000, sample_tokens: 500,
    train_tokens: 12000, cost: 0.0123 };

  it("adds up the current notebook's running sessions, matched by its file name", () => {
    const mine = notebookTotals(sessions, 'notebooks/00_quickstart.ipynb')!;
    expect(mine.sessions).toBe(1); // the finished one no longer runs
    expect(mine.cost).toBe(0.000456);
    expect(totalTokens(mine)).toBe(2000);
    expect(notebookTotals(sessions, 'other.ipynb')).toBeNull();
    expect(notebookTotals(sessions, null)).toBeNull();
  });
  it('follows a renamed notebook by the path its kernel runs now, not the name it started under', () => {
    const renamed = [{ ...sessions[0], display_name: 'Untitled.ipynb', notebook: 'work/train.ipynb' }];
    expect(notebookTotals(renamed, 'work/train.ipynb')!.cost).toBe(0.000456);
    expect(notebookTotals(renamed, 'Untitled.ipynb')).toBeNull(); // a new notebook of the old name is another
    expect(notebookTotals(renamed, 'train.ipynb')).toBeNull(); // the same name elsewhere is another notebook
    expect(sessionTitle(renamed[0])).toBe('train.ipynb');
    expect(sessionTitle(sessions[0])).toBe('00_quickstart.ipynb');
    expect(sessionTitle({ ...sessions[0], display_name: null })).toBe('a');
  });
  it('names a run within its session', () => {
    expect(runLabel('s1:train:2', 's1')).toBe('train:2');
    expect(runLabel('other:train:0', 's1')).toBe('other:train:0');
  });
  it("shows the notebook's cost and tokens, then the lab's; the lab's alone elsewhere", () => {
    const mine = notebookTotals(sessions, '00_quickstart.ipynb');
    expect(statusText(mine, lab)).toBe('Stepwise notebook $0.000456 · 2k tok · lab $0.0123');
    expect(statusText(null, lab)).toBe('Stepwise lab $0.0123 · 13.5k tok');
  });
  it('splits prefill, sample and train in the tooltip', () => {
    const mine = notebookTotals(sessions, '00_quickstart.ipynb');
    expect(statusTooltip('00_quickstart.ipynb', mine, lab, '€').split('\n')).toEqual([
      '00_quickstart.ipynb: 1 running session, €0.000456',
      '  prefill 100 · sample 50 · train 1.9k tokens',
      'This lab since 2026-01-01 09:30 UTC: 4 sessions, €0.0123',
      '  prefill 1k · sample 500 · train 12k tokens'
    ]);
  });
});

describe('budgets', () => {
  const budget = (extra: Partial<IBudget> = {}): IBudget => ({
    scope: 'session', target: 'a', budget_usd: 0.5, budget_tokens: null, spent_usd: 0, spent_tokens: 0,
    pending_usd: 0, fraction: 0, state: 'ok', ...extra
  });

  it('says what was spent of it, two significant digits each, as workbench/widgets/cost.py does', () => {
    expect(budgetText(budget({ spent_usd: 0.41, fraction: 0.82, state: 'warning' }))).toBe('$0.41 of $0.50 (82%)');
    expect(budgetText(budget({ budget_usd: 0.00005, spent_usd: 0.00003995, fraction: 0.799 })))
      .toBe('$0.000040 of $0.000050 (79%)'); // rounded down: 79.9% is not yet 80%
    expect(budgetText(budget({ budget_usd: null, budget_tokens: 5000, spent_tokens: 1200, fraction: 0.24 })))
      .toBe('1,200 of 5,000 tokens (24%)');
    expect(budgetText(budget({ budget_usd: 12, spent_usd: 3.1, budget_tokens: 5000, spent_tokens: 4500, fraction: 0.9 }), '€'))
      .toBe('€3.10 of €12.00 · 4,500 of 5,000 tokens (90%)');
    expect(budgetText(budget({ spent_usd: 0.29, fraction: 0.58 }))).toBe('$0.29 of $0.50 (58%)'); // 0.58 * 100 < 58
    expect(budgetText(budget({ budget_usd: 0.0001, spent_usd: 0.0000234, fraction: 0.234 }))).toBe('$0.000023 of $0.00010 (23%)');
    expect(budgetText(budget({ spent_usd: 0.041, fraction: 0.082 }))).toBe('$0.041 of $0.50 (8%)');
    expect(budgetText(budget({ spent_usd: 0.00041, fraction: 0.00082 }))).toBe('$0.00041 of $0.50 (0%)');
  });

  it('names the budget and what its state means in a tooltip line', () => {
    expect(budgetLine(budget({ scope: 'run', target: 'a:train:0', spent_usd: 0.45, fraction: 0.9, state: 'warning' })))
      .toBe('Budget of run a:train:0: $0.45 of $0.50 (90%): nearly spent');
    expect(budgetLine(budget({ spent_usd: 0.5, fraction: 1, state: 'exhausted' })))
      .toContain('exhausted, the backend refuses more work (workbench.set_budget(usd=...) raises it)');
    expect(budgetLine(budget())).toBe('Budget of session a: $0.00 of $0.50 (0%)');
  });

  it("picks the notebook's tightest budget: the worst state, then the fullest, its runs' included", () => {
    const run = (n: number, b: IBudget | null) => ({ training_run_id: `a:train:${n}`, base_model: 'm', lora_rank: 8,
      steps: 1, last_loss: null, budget: b });
    const mine: ISession = {
      session_id: 'a', status: 'active', created_at: '', age_s: 1, display_name: 'nb.ipynb', base_model: null,
      lora_rank: null, training_run_ids: [], prefill_tokens: 0, sample_tokens: 0, train_tokens: 0, cost: 0,
      checkpoints: [], sampler_snapshots: [], backend: 'b', budget: budget({ fraction: 0.95, state: 'warning' }),
      runs: [run(0, budget({ scope: 'run', target: 'a:train:0', fraction: 0.9, state: 'exhausted' })), run(1, null)]
    };
    const other = { ...mine, session_id: 'b', display_name: 'other.ipynb', budget: budget({ target: 'b', state: 'exhausted', fraction: 1 }), runs: [] };
    const ended = { ...mine, session_id: 'c', status: 'finished', budget: budget({ target: 'c', state: 'exhausted', fraction: 1 }), runs: [] };
    expect(notebookBudget([mine, other, ended], 'nb.ipynb')!.target).toBe('a:train:0'); // exhausted beats 95%
    expect(notebookBudget([{ ...mine, runs: [] }], 'nb.ipynb')!.fraction).toBe(0.95);
    expect(notebookBudget([{ ...mine, budget: null, runs: [run(1, null)] }], 'nb.ipynb')).toBeNull();
    expect(notebookBudget([mine], null)).toBeNull();
  });

  it("counts the tenant's budget as a session's: the tightest wins, for any notebook", () => {
    const mine = {
      session_id: 'a', status: 'active', created_at: '', age_s: 1, display_name: 'nb.ipynb', base_model: null,
      lora_rank: null, training_run_ids: [], prefill_tokens: 0, sample_tokens: 0, train_tokens: 0, cost: 0,
      checkpoints: [], sampler_snapshots: [], backend: 'b', budget: budget({ fraction: 0.85, state: 'warning' }), runs: []
    } as ISession;
    const tenant = budget({ scope: 'tenant', target: 'alice', budget_usd: 0.001, spent_usd: 0.0012, fraction: 1.2,
      state: 'exhausted' });
    expect(notebookBudget([mine], 'nb.ipynb', tenant)).toBe(tenant);
    expect(notebookBudget([mine], 'nb.ipynb', { ...tenant, fraction: 0.5, state: 'ok' })).toBe(mine.budget);
    expect(notebookBudget([], 'nb.ipynb', tenant)).toBe(tenant); // no session yet: the tenant's work is refused all the same
    expect(notebookBudget([mine], null, tenant)).toBe(tenant);
    expect(notebookBudget([mine], 'nb.ipynb', null)).toBe(mine.budget);
  });

  it("says a tenant's budget is the tenant's, and that the operator raises it", () => {
    const tenant = budget({ scope: 'tenant', target: 'alice', budget_usd: 0.001, spent_usd: 0.0012, fraction: 1.2,
      state: 'exhausted' });
    expect(budgetLine(tenant)).toBe(
      "The tenant's budget (tenant alice, every session of it counts): $0.0012 of $0.0010 (120%): exhausted, the " +
        'backend refuses more work of every session of the tenant (the server operator raises it)');
    expect(budgetLine({ ...tenant, fraction: 0.5, spent_usd: 0.0005, state: 'ok' }))
      .toBe("The tenant's budget (tenant alice, every session of it counts): $0.00050 of $0.0010 (50%)");
  });
});

describe('a run\'s steps and loss (issue 56)', () => {
  const run = (extra: object) => ({ training_run_id: 'a:train:0', base_model: 'm', lora_rank: 8, steps: 6,
    last_loss: -174.0, ...extra });

  it('gives the loss per token where the backend counted the tokens, else the sum said to be one', () => {
    expect(lossText(run({ loss_step: 6, loss_per_token: 0.0471 }))).toBe('loss/token 0.04710');
    expect(lossText(run({ loss_step: 5, loss_per_token: 0.0471 }))).toBe('loss/token 0.04710 at step 5');
    expect(lossText(run({ loss_step: 6, loss_per_token: null }))).toBe('summed loss -174.0');
    expect(lossText(run({}))).toBe('summed loss -174.0'); // a backend from before: no step, no per token
    expect(lossText(run({ last_loss: null }))).toBe('no loss yet');
  });

  it('counts skipped steps beside the steps', () => {
    expect(stepsText(run({ skipped_steps: 1 }))).toBe('6 steps (1 skipped)');
    expect(stepsText(run({ skipped_steps: 0 }))).toBe('6 steps');
    expect(stepsText(run({ steps: 1 }))).toBe('1 step');
  });

  it('counts refused steps apart from skipped ones, and says why they had no gradient (issue 65)', () => {
    const refusal = { status: 402, request_type: 'forward_backward', at: '2026-12-07T10:00:00Z',
      message: "tenant 'alice' budget of $0.0010 is spent ($0.0012 of it)" };
    expect(stepsText(run({ refused_steps: 6, skipped_steps: 0 }))).toBe('6 steps (6 refused)');
    expect(stepsText(run({ refused_steps: 2, skipped_steps: 1 }))).toBe('6 steps (2 refused, 1 skipped)');
    expect(stepsText(run({ refused_steps: 0 }))).toBe('6 steps');
    const refused = run({ refused_steps: 6, last_refusal: refusal });
    expect(stepsTooltip(refused)).toBe(
      "6 steps refused: the server refused their forward_backward (402 tenant 'alice' budget of $0.0010 is spent " +
        '($0.0012 of it)), so the optim_step after it had no gradient. Await each forward_backward (.result()) to ' +
        'see the error where it happens.');
    expect(lossTooltip(refused).split('\n')).toEqual([
      "loss:sum -174: the last forward_backward's loss, summed over its tokens", stepsTooltip(refused)]);
    expect(stepsTooltip(run({ refused_steps: 1 }))).toMatch(/^1 step refused: the server refused their forward_backward, so/);
    expect(stepsTooltip(run({ refused_steps: 1, skipped_steps: 1 })).split('\n')[1]).toMatch(/^1 step skipped: /);
    expect(stepsTooltip(run({}))).toBe('');
  });

  it("says how many of a session's requests were refused, with the newest's status and the server's words", () => {
    const last = { status: 402, request_type: 'forward_backward', at: '2026-12-07T10:00:00.123Z',
      message: "tenant 'alice' budget of $0.0010 is spent" };
    expect(refusalText({ count: 6, last })).toBe("6 requests refused · 402: tenant 'alice' budget of $0.0010 is spent");
    expect(refusalText({ count: 1, last: { ...last, status: 429, message: 'slow down' } }))
      .toBe('1 request refused · 429: slow down');
    expect(refusalTooltip({ count: 6, last })).toBe(
      '6 requests of this session refused by the server; the newest, forward_backward at 2026-12-07 10:00:00:\n' +
        "402 tenant 'alice' budget of $0.0010 is spent");
  });

  it('names a session by the name given to connect() first', () => {
    const base = { session_id: 's', display_name: 'x.ipynb', notebook: 'dir/y.ipynb' } as ISession;
    expect(sessionTitle({ ...base, user_metadata: { name: 'warehouse-agent' } })).toBe('warehouse-agent');
    expect(sessionTitle({ ...base, user_metadata: {} })).toBe('y.ipynb');
    expect(sessionTitle({ ...base, notebook: null })).toBe('x.ipynb');
  });

  it('reads the lab\'s start as a UTC time', () => {
    expect(utcTime('2026-12-05T23:40:12.5+00:00')).toBe('23:40 UTC');
    expect(utcTime('')).toBe('');
  });
});
