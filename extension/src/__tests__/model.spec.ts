import { emptyLab, emptyRunning, SessionsModel, sortSessions } from '../model';
import { IReport, ISession } from '../types';

function session(id: string, status: string, created_at: string, extra: Partial<ISession> = {}): ISession {
  return {
    session_id: id,
    status,
    created_at,
    age_s: 1,
    display_name: null,
    base_model: 'HuggingFaceTB/SmolLM2-135M-Instruct',
    lora_rank: 8,
    training_run_ids: [],
    runs: [],
    prefill_tokens: 0,
    sample_tokens: 0,
    train_tokens: 0,
    cost: 0,
    checkpoints: [],
    sampler_snapshots: [],
    backend: 'http://127.0.0.1:1',
    ...extra
  };
}

function report(sessions: ISession[], cost = 0): IReport {
  return {
    sessions,
    running: { ...emptyRunning(), sessions: sessions.length, cost },
    lab: emptyLab(),
    backends: [],
    currency: 'USD',
    runtime_dir: '/tmp/runtime',
    message: null
  };
}

describe('sortSessions', () => {
  it('puts active sessions first, newest first within each group', () => {
    const sorted = sortSessions([
      session('old-done', 'finished', '2026-01-01T00:00:00Z'),
      session('old-active', 'active', '2026-01-01T00:00:00Z'),
      session('new-done', 'expired', '2026-01-03T00:00:00Z'),
      session('new-active', 'active', '2026-01-02T00:00:00Z')
    ]);
    expect(sorted.map(s => s.session_id)).toEqual(['new-active', 'old-active', 'new-done', 'old-done']);
  });
});

describe('SessionsModel', () => {
  it('holds the latest report, sorted, and signals each update', async () => {
    const answers = [
      report([session('a', 'finished', '2026-01-01T00:00:00Z')], 0),
      report([session('a', 'finished', '2026-01-01T00:00:00Z'), session('b', 'active', '2026-01-02T00:00:00Z')], 0.5)
    ];
    const model = new SessionsModel({ fetch: async () => answers.shift()! });
    let signals = 0;
    model.changed.connect(() => signals++);
    expect(model.report).toBeNull();
    expect(model.running.cost).toBe(0);

    await model.update();
    expect(model.sessions.map(s => s.session_id)).toEqual(['a']);
    await model.update();
    expect(model.sessions.map(s => s.session_id)).toEqual(['b', 'a']);
    expect(model.running.cost).toBe(0.5);
    expect(signals).toBe(2);
    model.dispose();
  });

  it("keeps the tenant's budget (the report's top-level one), null when it has none or the backend is older", async () => {
    const tenant = { scope: 'tenant', target: 'alice', budget_usd: 0.001, budget_tokens: null, spent_usd: 0.0012,
      spent_tokens: 0, pending_usd: 0, fraction: 1.2, state: 'exhausted' as const };
    const answers = [{ ...report([]), budget: tenant }, { ...report([]), budget: null }, report([])];
    const model = new SessionsModel({ fetch: async () => answers.shift()! });
    expect(model.tenantBudget).toBeNull();
    await model.update();
    expect(model.tenantBudget).toEqual(tenant);
    await model.update();
    expect(model.tenantBudget).toBeNull();
    await model.update();
    expect(model.tenantBudget).toBeNull();
    model.dispose();
  });

  it("takes the tightest of the backends' tenant budgets where the lab passes them on per backend", async () => {
    const tenant = (target: string, fraction: number, state: 'ok' | 'warning' | 'exhausted') => ({
      scope: 'tenant', target, budget_usd: 1, budget_tokens: null, spent_usd: fraction, spent_tokens: 0,
      pending_usd: 0, fraction, state });
    const backend = (budget: ReturnType<typeof tenant> | null) => ({
      base_url: 'http://127.0.0.1:1', embedded: true, started: '', kernel_pids: [], sessions: 0, error: null, budget });
    const answers = [{ ...report([]), backends: [backend(tenant('a', 0.9, 'warning')), backend(null), backend(tenant('b', 1, 'exhausted'))] }];
    const model = new SessionsModel({ fetch: async () => answers.shift()! });
    await model.update();
    expect(model.tenantBudget!.target).toBe('b');
    model.dispose();
  });

  it('keeps the last good report when a poll fails, and clears the error on the next good one', async () => {
    let fail = false;
    const model = new SessionsModel({
      fetch: async () => {
        if (fail) {
          throw new Error('the Jupyter server did not answer');
        }
        return report([session('a', 'active', '2026-01-01T00:00:00Z')], 0.25);
      }
    });
    await model.update();
    fail = true;
    await model.update();
    expect(model.error).toBe('the Jupyter server did not answer');
    expect(model.sessions).toHaveLength(1);
    expect(model.running.cost).toBe(0.25);
    fail = false;
    await model.update();
    expect(model.error).toBeNull();
    model.dispose();
  });

  it('remembers which sessions are expanded', () => {
    const model = new SessionsModel({ fetch: async () => report([]) });
    let signals = 0;
    model.changed.connect(() => signals++);
    model.toggle('x');
    expect(model.isExpanded('x')).toBe(true);
    model.toggle('x');
    expect(model.isExpanded('x')).toBe(false);
    expect(signals).toBe(2);
    model.dispose();
  });

  it('polls at its interval once started, follows a new interval, and stops when disposed', async () => {
    let calls = 0;
    const model = new SessionsModel({
      fetch: async () => {
        calls++;
        return report([]);
      },
      interval: 20
    });
    await sleep(60);
    expect(calls).toBe(0); // nothing before start()
    model.start();
    await sleep(150);
    expect(calls).toBeGreaterThanOrEqual(3);

    model.interval = 10_000; // polls once now, then waits the new interval
    await sleep(30);
    const after = calls;
    await sleep(150);
    expect(calls).toBe(after);
    expect(model.interval).toBe(10_000);

    model.dispose();
    expect(model.isDisposed).toBe(true);
  });
});

function sleep(ms: number): Promise<void> {
  return new Promise(resolve => setTimeout(resolve, ms));
}
