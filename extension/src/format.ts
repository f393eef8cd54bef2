/**
 * How numbers read in the sidebar and the status bar. Pure functions, unit-tested.
 *
 * Costs of a small model are fractions of a cent, so a fixed two decimals would show $0.00 for a
 * whole training run: below a cent we keep three significant digits instead.
 */

import { IRunning, ISession, Kind } from './types';

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

export function sessionTitle(session: ISession): string {
  return session.display_name || session.session_id;
}

/** "3 steps" / "1 step". */
export function plural(n: number, word: string): string {
  return `${n} ${word}${n === 1 ? '' : 's'}`;
}

/** The status item's text: cost and tokens of the running sessions. */
export function statusText(running: IRunning, symbol = '$'): string {
  const tokens = running.prefill_tokens + running.sample_tokens + running.train_tokens;
  return `Stepwise ${formatCost(running.cost, symbol)} · ${formatTokens(tokens)} tok`;
}

/** The status item's tooltip: the split by kind. */
export function statusTooltip(running: IRunning, symbol = '$'): string {
  const kinds: Kind[] = ['prefill', 'sample', 'train'];
  const lines = kinds.map(kind => {
    const part = running.by_kind[kind];
    return `${kind}: ${formatTokens(part.tokens)} tokens, ${formatCost(part.cost, symbol)}`;
  });
  const head = `${plural(running.sessions, 'running session')}, ${formatCost(running.cost, symbol)}`;
  return [head, ...lines].join('\n');
}
