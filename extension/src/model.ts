/**
 * The data model the sidebar and the status bar share: the latest report, polled from the server
 * extension at the settings' interval, and which sessions the user has expanded.
 *
 * The fetch function is injected, so the model runs (and is tested) without a Jupyter server.
 * A failed poll keeps the last good report on screen and sets `error`, so a hiccup does not blank
 * the sidebar; the next good poll clears it.
 */

import { IDisposable } from '@lumino/disposable';
import { Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';

import { tightestBudget } from './format';
import { IBudget, ILab, IReport, IRunning, ISession } from './types';

export const DEFAULT_INTERVAL_MS = 2000;

export interface IModelOptions {
  fetch: () => Promise<IReport>;
  interval?: number; // milliseconds between polls
}

export function emptyRunning(): IRunning {
  return {
    sessions: 0,
    prefill_tokens: 0,
    sample_tokens: 0,
    train_tokens: 0,
    cost: 0,
    by_kind: {
      prefill: { tokens: 0, cost: 0 },
      sample: { tokens: 0, cost: 0 },
      train: { tokens: 0, cost: 0 }
    }
  };
}

export function emptyLab(): ILab {
  return { since: '', sessions: 0, prefill_tokens: 0, sample_tokens: 0, train_tokens: 0, cost: 0 };
}

/** Active sessions first, then newest first. */
export function sortSessions(sessions: ISession[]): ISession[] {
  const rank = (s: ISession) => (s.status === 'active' ? 0 : 1);
  return [...sessions].sort(
    (a, b) =>
      rank(a) - rank(b) || Date.parse(b.created_at) - Date.parse(a.created_at)
  );
}

export class SessionsModel implements IDisposable {
  constructor(options: IModelOptions) {
    this._fetch = options.fetch;
    this._interval = options.interval ?? DEFAULT_INTERVAL_MS;
    this._poll = new Poll({
      factory: () => this.update(),
      frequency: frequency(this._interval),
      standby: 'when-hidden', // no polling from a background browser tab
      auto: false
    });
  }

  /** Emitted after every poll, good or failed. */
  get changed(): ISignal<this, void> {
    return this._changed;
  }

  get report(): IReport | null {
    return this._report;
  }

  /** Why the last poll failed (the last good report is still shown), or null. */
  get error(): string | null {
    return this._error;
  }

  get sessions(): ISession[] {
    return this._sessions;
  }

  get running(): IRunning {
    return this._report?.running ?? emptyRunning();
  }

  /**
   * The tenant's budget, which refuses the work of every session of the tenant: the report's top-level one,
   * else the tightest of its backends' (a lab merges the reports of several backends, each of one tenant).
   */
  get tenantBudget(): IBudget | null {
    const report = this._report;
    if (!report) {
      return null;
    }
    return report.budget ?? tightestBudget((report.backends ?? []).map(backend => backend.budget));
  }

  get currency(): string {
    return this._report?.currency ?? 'USD';
  }

  /** Milliseconds between polls; setting it takes effect at once. */
  get interval(): number {
    return this._interval;
  }
  set interval(ms: number) {
    if (!(ms > 0) || ms === this._interval) {
      return;
    }
    this._interval = ms;
    this._poll.frequency = frequency(ms);
    if (this._started) {
      void this._poll.refresh(); // poll now; the next ones follow the new interval
    }
  }

  isExpanded(sessionId: string): boolean {
    return this._expanded.has(sessionId);
  }

  toggle(sessionId: string): void {
    if (!this._expanded.delete(sessionId)) {
      this._expanded.add(sessionId);
    }
    this._changed.emit();
  }

  /** Start polling (the first poll runs at once). */
  start(): void {
    this._started = true;
    void this._poll.start();
  }

  /** Fetch now; never rejects (a failure lands in `error`). */
  async update(): Promise<void> {
    try {
      const report = await this._fetch();
      this._report = report;
      this._sessions = sortSessions(report.sessions);
      this._error = null;
    } catch (error) {
      this._error = error instanceof Error ? error.message : String(error);
    }
    if (!this.isDisposed) {
      this._changed.emit();
    }
  }

  get isDisposed(): boolean {
    return this._disposed;
  }

  dispose(): void {
    if (this._disposed) {
      return;
    }
    this._disposed = true;
    void this._poll.stop(); // clears the pending timer, which dispose() alone leaves behind
    this._poll.dispose();
    Signal.clearData(this);
  }

  private _fetch: () => Promise<IReport>;
  private _interval: number;
  private _poll: Poll;
  private _report: IReport | null = null;
  private _sessions: ISession[] = [];
  private _error: string | null = null;
  private _expanded = new Set<string>();
  private _changed = new Signal<this, void>(this);
  private _disposed = false;
  private _started = false;
}

function frequency(interval: number) {
  // Failures are caught in update(), so the poll never backs off: a backend that comes back shows at once.
  return { interval, backoff: false, max: Math.max(interval, 60_000) };
}
