import {
  formatAge,
  formatCost,
  formatLoss,
  formatTokens,
  plural,
  shortModel,
  notebookTotals,
  runLabel,
  sessionTitle,
  statusText,
  statusTooltip,
  totalTokens
} from '../format';
import { ILab, ISession } from '../types';

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
    expect(statusText(mine, lab)).toBe('Stepwise $0.000456 · 2k tok · lab $0.0123');
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
