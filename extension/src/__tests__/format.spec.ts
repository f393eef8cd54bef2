import {
  formatAge,
  formatCost,
  formatLoss,
  formatTokens,
  plural,
  shortModel,
  statusText,
  statusTooltip
} from '../format';
import { IRunning } from '../types';

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
  const running: IRunning = {
    sessions: 2,
    prefill_tokens: 100,
    sample_tokens: 50,
    train_tokens: 1850,
    cost: 0.000456,
    by_kind: {
      prefill: { tokens: 100, cost: 0.00001 },
      sample: { tokens: 50, cost: 0.000046 },
      train: { tokens: 1850, cost: 0.0004 }
    }
  };
  it('shows the running cost and all tokens', () => {
    expect(statusText(running)).toBe('Stepwise $0.000456 · 2k tok');
  });
  it('splits prefill, sample and train in the tooltip', () => {
    expect(statusTooltip(running, '€').split('\n')).toEqual([
      '2 running sessions, €0.000456',
      'prefill: 100 tokens, €0.0000100',
      'sample: 50 tokens, €0.0000460',
      'train: 1.9k tokens, €0.000400'
    ]);
  });
});
