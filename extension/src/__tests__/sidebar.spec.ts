/**
 * @jest-environment jsdom
 */
// The sidebar drawn from a model in a DOM: rows, their facts, expanding, copying, and updates in place.
// JupyterLab's clipboard and icon registry are stand-ins here; everything else is the real code.

import './jsdom-shims';

import { emptyLab, emptyRunning, SessionsModel } from '../model';
import { SessionsSidebar } from '../sidebar';
import { IBudget, IReport, ISession } from '../types';

const copied: string[] = [];
jest.mock('@jupyterlab/apputils', () => ({
  Clipboard: { copyToSystem: (text: string) => copied.push(text) }
}));
jest.mock('../icon', () => ({ stepwiseIcon: null }));

function session(id: string, extra: Partial<ISession> = {}): ISession {
  return {
    session_id: id,
    status: 'active',
    created_at: '2026-01-01T00:00:00Z',
    age_s: 75,
    display_name: null,
    base_model: 'HuggingFaceTB/SmolLM2-135M-Instruct',
    lora_rank: 8,
    training_run_ids: [`${id}:train:0`],
    runs: [{ training_run_id: `${id}:train:0`, base_model: 'HuggingFaceTB/SmolLM2-135M-Instruct', lora_rank: 8,
             steps: 3, last_loss: 12.3456 }],
    prefill_tokens: 0,
    sample_tokens: 20,
    train_tokens: 1500,
    cost: 0.000123,
    checkpoints: [],
    sampler_snapshots: [],
    backend: 'http://127.0.0.1:1',
    ...extra
  };
}

function report(sessions: ISession[], extra: Partial<IReport> = {}): IReport {
  return {
    sessions,
    running: { ...emptyRunning(), sessions: 1, cost: 0.000123 },
    lab: { ...emptyLab(), sessions: 2, cost: 0.000456 },
    backends: [
      { base_url: 'http://127.0.0.1:1', embedded: true, started: '', kernel_pids: [1], sessions: 1, error: null }
    ],
    currency: 'USD',
    runtime_dir: '/tmp/runtime',
    message: null,
    ...extra
  };
}

async function drawn(answers: IReport[]) {
  const model = new SessionsModel({ fetch: async () => answers.shift()! });
  const sidebar = new SessionsSidebar(model);
  await model.update();
  return { model, sidebar, node: sidebar.node };
}

const rows = (node: HTMLElement) => Array.from(node.querySelectorAll<HTMLElement>('li.jp-StepwiseSession'));
const text = (node: Element, cls: string) => node.querySelector(`.jp-StepwiseSession-${cls}`)!.textContent;
const runTexts = (row: Element) =>
  Array.from(row.querySelectorAll('li.jp-StepwiseRun')).map(run =>
    Array.from(run.children).map(span => span.textContent).join(' · '));

describe('SessionsSidebar', () => {
  it('draws one row per session with its model, rank, steps, loss, tokens, cost and age', async () => {
    const { node, model } = await drawn([report([session('a')])]);
    const [row] = rows(node);
    expect(text(row, 'title')).toBe('a');
    expect(text(row, 'model')).toBe('SmolLM2-135M-Instruct');
    expect(text(row, 'rank')).toBe('LoRA r8');
    expect(runTexts(row)).toEqual(['train:0 · 3 steps · summed loss 12.35']);
    expect(text(row, 'train')).toBe('train 1.5k');
    expect(text(row, 'cost')).toBe('$0.000123');
    expect(text(row, 'age')).toBe('1m 15s');
    const summary = node.querySelector<HTMLElement>('.jp-StepwiseSidebar-summary')!;
    expect(Array.from(summary.children).map(part => part.textContent!.trim())).toEqual([
      '1 session · 1 running', 'running sessions $0.000123', 'lab total $0.000456']);
    model.dispose();
  });

  it('names a full fine-tuning run (rank 0) as such, not as LoRA', async () => {
    const { node, model } = await drawn([report([session('a', { lora_rank: 0 })])]);
    expect(text(rows(node)[0], 'rank')).toBe('full fine-tuning');
    model.dispose();
  });

  it('updates rows in place and keeps the sorted order', async () => {
    const [run] = session('a').runs;
    const { node, model } = await drawn([
      report([session('a')]),
      report([session('a', { runs: [{ ...run, steps: 4 }] }), session('b', { created_at: '2026-01-02T00:00:00Z' })])
    ]);
    const first = rows(node)[0];
    await model.update();
    expect(rows(node).map(r => r.dataset.sessionId)).toEqual(['b', 'a']);
    expect(rows(node)[1]).toBe(first); // the same element, not a redraw
    expect(runTexts(first)).toEqual(['train:0 · 4 steps · summed loss 12.35']);
    model.dispose();
  });

  it('draws forks indented under the run they branched from, named, with their fork step', async () => {
    const run = (n: number, name: string | null, parent: string | null = null, forkStep: number | null = null) => ({
      training_run_id: `a:train:${n}`, base_model: 'HuggingFaceTB/SmolLM2-135M-Instruct', lora_rank: 8,
      steps: 2, last_loss: 1.5, user_metadata: (name ? { name } : {}) as Record<string, string>,
      parent_run_id: parent, fork_step: forkStep
    });
    // Made in this order: the grandchild (3) before the second child (2) of the root.
    const runs = [run(0, 'base'), run(1, 'hot', 'a:train:0', 3), run(3, null, 'a:train:1', 5),
                  run(2, 'cold', 'a:train:0', 1), run(4, 'elsewhere', 'b:train:0', 2)];
    const { node, model } = await drawn([report([session('a', { runs })])]);
    const [row] = rows(node);
    const items = Array.from(row.querySelectorAll<HTMLElement>('li.jp-StepwiseRun'));
    expect(items.map(i => [i.dataset.runId, i.dataset.depth])).toEqual([
      ['a:train:0', '0'], ['a:train:1', '1'], ['a:train:3', '2'], ['a:train:2', '1'], ['a:train:4', '0']]);
    expect(runTexts(row)).toEqual([
      'base · 2 steps · summed loss 1.500',
      'hot · from base @ step 3 · 2 steps · summed loss 1.500',
      'train:3 · from hot @ step 5 · 2 steps · summed loss 1.500',
      'cold · from base @ step 1 · 2 steps · summed loss 1.500',
      'elsewhere · from b:train:0 @ step 2 · 2 steps · summed loss 1.500'
    ]);
    expect(items[2].style.paddingLeft).toBe('28px');
    model.dispose();
  });

  it("shows each of a session's runs with its own steps and loss, never their sum", async () => {
    const run = (n: number, steps: number, loss: number | null, rank = 8) => ({
      training_run_id: `a:train:${n}`, base_model: 'HuggingFaceTB/SmolLM2-135M-Instruct', lora_rank: rank,
      steps, last_loss: loss });
    const { node, model } = await drawn([report([session('a', { runs: [run(0, 30, 1.5), run(1, 6, 2.25), run(2, 2, null, 16)] })])]);
    const [row] = rows(node);
    expect(row.dataset.runs).toBe('3');
    expect(runTexts(row)).toEqual(['train:0 · 30 steps · summed loss 1.500', 'train:1 · 6 steps · summed loss 2.250',
      'train:2 · 2 steps · no loss yet · SmolLM2-135M-Instruct r16']);
    expect(row.textContent).not.toContain('38');
    model.dispose();
  });

  it('lists sampler snapshots beside the saved checkpoints, saying they have no path', async () => {
    const saved = { tinker_path: 'tinker://a:train:0/sampler_weights/final', checkpoint_type: 'sampler',
      time: '2026-01-01T00:02:00Z', training_run_id: 'a:train:0' };
    const snapshot = { sampler_id: 'a:sample:3', training_run_id: 'a:train:0', time: '2026-01-01T00:01:00Z' };
    const { node, model } = await drawn([report([session('a', { sampler_snapshots: [snapshot] }),
      session('b', { checkpoints: [{ ...saved, training_run_id: 'b:train:0' }] })])]);
    const [a, b] = rows(node);
    a.querySelector<HTMLButtonElement>('.jp-StepwiseSession-header')!.click();
    b.querySelector<HTMLButtonElement>('.jp-StepwiseSession-header')!.click();
    expect(a.querySelector('.jp-StepwiseCheckpoint-none')).toBeNull();
    expect(a.querySelector('.jp-StepwiseSnapshot-id')!.textContent).toBe('a:sample:3');
    expect(a.querySelector('.jp-StepwiseSnapshot')!.textContent).toContain('no tinker:// path');
    expect(a.querySelector('.jp-StepwiseCheckpoint-copy')).toBeNull();
    expect(b.querySelector('.jp-StepwiseCheckpoint[data-type="sampler"] .jp-StepwiseCheckpoint-type')!.textContent)
      .toBe('sampler weights · train:0 · 2026-01-01 00:02:00');
    model.dispose();
  });

  it('greys ended sessions in a group of their own that folds, their checkpoints still listed', async () => {
    const path = 'tinker://c:train:0/weights/final';
    const ended = session('c', { status: 'ended', remembered: true,
      checkpoints: [{ tinker_path: path, checkpoint_type: 'training', time: '2026-01-01T00:01:00Z', training_run_id: 'c:train:0' }] });
    const { node, model } = await drawn([report([ended, session('a'), session('b', { status: 'finished' })])]);
    const active = node.querySelector('.jp-StepwiseSidebar-list:not(.jp-StepwiseSidebar-ended)')!;
    const group = node.querySelector<HTMLElement>('.jp-StepwiseSidebar-ended')!;
    const header = node.querySelector<HTMLButtonElement>('.jp-StepwiseSidebar-endedHeader')!;
    expect(Array.from(active.children).map(r => (r as HTMLElement).dataset.sessionId)).toEqual(['a']);
    expect(Array.from(group.children).map(r => (r as HTMLElement).dataset.sessionId)).toEqual(['c', 'b']);
    const [c] = rows(group);
    expect(c.classList.contains('jp-mod-ended')).toBe(true);
    expect(c.querySelector('.jp-StepwiseSession-header')!.getAttribute('title')).toContain('its backend stopped');
    expect(c.querySelector<HTMLElement>('.jp-StepwiseSession-age')!.hidden).toBe(true); // it stopped when last read
    c.querySelector<HTMLButtonElement>('.jp-StepwiseSession-header')!.click();
    expect(c.querySelector('.jp-StepwiseCheckpoint-path')!.textContent).toBe(path);
    expect(header.textContent).toBe('2 ended sessions · their checkpoints remain');
    expect(group.hidden).toBe(false);
    header.click();
    expect(group.hidden).toBe(true);
    expect(header.getAttribute('aria-expanded')).toBe('false');
    header.click();
    expect(group.hidden).toBe(false);
    model.dispose();
  });

  it('titles a session after the notebook its kernel runs now, and says what it started as', async () => {
    const { node, model } = await drawn([report([session('a', { display_name: 'Untitled.ipynb', notebook: 'w/train.ipynb' })])]);
    const [row] = rows(node);
    expect(text(row, 'title')).toBe('train.ipynb');
    expect(row.dataset.notebook).toBe('w/train.ipynb');
    expect(row.dataset.name).toBe('train.ipynb');
    expect(row.querySelector('.jp-StepwiseSession-header')!.getAttribute('title'))
      .toContain('started as Untitled.ipynb; its notebook is now w/train.ipynb');
    model.dispose();
  });

  it('expands a session on click to show its checkpoints, and copies a tinker:// path', async () => {
    const path = 'tinker://a:train:0/weights/step-3';
    const checkpoints = [{ tinker_path: path, checkpoint_type: 'training', time: '2026-01-01T00:01:00Z', training_run_id: 'a:train:0' }];
    const { node, model } = await drawn([report([session('a', { checkpoints })])]);
    const [row] = rows(node);
    const list = row.querySelector<HTMLElement>('.jp-StepwiseSession-checkpoints')!;
    expect(list.hidden).toBe(true);
    row.querySelector<HTMLButtonElement>('.jp-StepwiseSession-header')!.click();
    expect(list.hidden).toBe(false);
    expect(row.querySelector('.jp-StepwiseSession-header')!.getAttribute('aria-expanded')).toBe('true');
    expect(list.querySelector('.jp-StepwiseCheckpoint-path')!.textContent).toBe(path);
    const copy = list.querySelector<HTMLButtonElement>('.jp-StepwiseCheckpoint-copy')!;
    copy.click();
    expect(copied).toEqual([path]);
    expect(copy.textContent).toBe('Copied');
    model.dispose();
  });

  it('says why there is nothing to show, and names a backend that failed', async () => {
    const none = report([], { backends: [], message: 'No Stepwise backend is running: run workbench.connect()' });
    const { node, model } = await drawn([
      none,
      report([], { backends: [
        { base_url: 'http://127.0.0.1:1', embedded: true, started: '', kernel_pids: [1], sessions: 0, error: null },
        { base_url: 'http://127.0.0.1:2', embedded: false, started: '', kernel_pids: [2], sessions: 0, error: 'the backend at http://127.0.0.1:2 did not answer' }
      ] })
    ]);
    const message = node.querySelector<HTMLElement>('.jp-StepwiseSidebar-message')!;
    expect(message.hidden).toBe(false);
    expect(message.textContent).toContain('workbench.connect()');
    await model.update();
    expect(message.textContent).toContain('No sessions yet on 2 backends');
    expect(node.querySelector('.jp-StepwiseSidebar-backendError')!.textContent).toContain('did not answer');
    model.dispose();
  });

  it("draws a session's and a run's budget as a bar and its text, coloured by state, updated in place", async () => {
    const budget = (extra: Partial<IBudget>): IBudget => ({ scope: 'session', target: 'a', budget_usd: 0.5,
      budget_tokens: null, spent_usd: 0.41, spent_tokens: 0, pending_usd: 0, fraction: 0.82, state: 'warning', ...extra });
    const [run] = session('a').runs;
    const runBudget = budget({ scope: 'run', target: 'a:train:0', budget_usd: 0.2, spent_usd: 0.05, fraction: 0.25, state: 'ok' });
    const { node, model } = await drawn([
      report([session('a', { budget: budget({}), runs: [{ ...run, budget: runBudget }] }), session('b', { budget: null })]),
      report([session('a', { budget: budget({ spent_usd: 0.5, fraction: 1, state: 'exhausted' }) }), session('b')])
    ]);
    const [a, b] = rows(node);
    const bar = a.querySelector<HTMLElement>(':scope > .jp-StepwiseBudget')!;
    expect(bar.hidden).toBe(false);
    expect(bar.classList.contains('stepwise-budget-warning')).toBe(true);
    expect(bar.dataset.state).toBe('warning');
    expect(bar.querySelector<HTMLElement>('.jp-StepwiseBudget-bar')!.style.width).toBe('82%');
    expect(bar.querySelector('.jp-StepwiseBudget-text')!.textContent).toBe('$0.41 of $0.50 (82%)');
    expect(bar.title).toBe('Budget of session a: $0.41 of $0.50 (82%): nearly spent');
    const ofRun = a.querySelector<HTMLElement>('li.jp-StepwiseRun .jp-StepwiseBudget')!;
    expect(ofRun.classList.contains('stepwise-budget-ok')).toBe(true);
    expect(ofRun.querySelector('.jp-StepwiseBudget-text')!.textContent).toBe('$0.050 of $0.20 (25%)');
    expect(b.querySelector<HTMLElement>(':scope > .jp-StepwiseBudget')!.hidden).toBe(true); // none: nothing shown

    await model.update(); // spent: red, full, the same element; the run's budget was removed
    expect(rows(node)[0].querySelector(':scope > .jp-StepwiseBudget')).toBe(bar);
    expect(bar.classList.contains('stepwise-budget-exhausted')).toBe(true);
    expect(bar.classList.contains('stepwise-budget-warning')).toBe(false);
    expect(bar.querySelector<HTMLElement>('.jp-StepwiseBudget-bar')!.style.width).toBe('100%');
    expect(bar.title).toContain('exhausted, the backend refuses more work');
    expect(a.querySelector('li.jp-StepwiseRun .jp-StepwiseBudget')).toBeNull();
    model.dispose();
  });

  it("draws the tenant's budget under the header, coloured by its state, hidden without one (issue 65)", async () => {
    const tenant: IBudget = { scope: 'tenant', target: 'alice', budget_usd: 0.001, budget_tokens: null,
      spent_usd: 0.0012, spent_tokens: 0, pending_usd: 0, fraction: 1.2, state: 'exhausted' };
    const { node, model } = await drawn([report([session('a')], { budget: tenant }), report([session('a')])]);
    const bar = node.querySelector<HTMLElement>('.jp-StepwiseSidebar-header .jp-StepwiseSidebar-tenantBudget')!;
    expect(bar.hidden).toBe(false);
    expect(bar.classList.contains('stepwise-budget-exhausted')).toBe(true);
    expect(bar.dataset.scope).toBe('tenant');
    expect(bar.querySelector('.jp-StepwiseBudget-text')!.textContent).toBe('tenant budget $0.0012 of $0.0010 (120%)');
    expect(bar.querySelector<HTMLElement>('.jp-StepwiseBudget-bar')!.style.width).toBe('100%');
    expect(bar.title).toMatch(/^The tenant's budget \(tenant alice, every session of it counts\): .*exhausted/);
    await model.update(); // removed (or an older backend): nothing shown
    expect(bar.hidden).toBe(true);
    model.dispose();
  });

  it('counts refused steps on a run and shows a session\'s refusals in red with the server\'s words (issue 65)', async () => {
    const refusal = { status: 402, request_type: 'forward_backward', at: '2026-12-07T10:00:00Z',
      message: "tenant 'alice' budget of $0.0010 is spent ($0.0012 of it); ask the operator to raise it" };
    const [run] = session('a').runs;
    const { node, model } = await drawn([
      report([session('a', { runs: [{ ...run, steps: 6, refused_steps: 6, skipped_steps: 0, last_refusal: refusal }],
                             refusals: { count: 6, last: refusal } }), session('b')]),
      report([session('a', { refusals: null }), session('b')])
    ]);
    const [a, b] = rows(node);
    const item = a.querySelector<HTMLElement>('li.jp-StepwiseRun')!;
    expect(item.dataset.refused).toBe('6');
    expect(item.dataset.skipped).toBe('0');
    const steps = item.querySelector<HTMLElement>('.jp-StepwiseRun-steps')!;
    expect(steps.textContent).toBe('6 steps (6 refused)');
    expect(steps.classList.contains('jp-mod-refused')).toBe(true);
    expect(steps.title).toContain('6 steps refused: the server refused their forward_backward (402 tenant');
    expect(item.querySelector<HTMLElement>('.jp-StepwiseRun-loss')!.title).toContain('Await each forward_backward');
    const line = a.querySelector<HTMLElement>('.jp-StepwiseRefusals')!;
    expect(line.hidden).toBe(false);
    expect(line.textContent).toBe(`6 requests refused · 402: ${refusal.message}`);
    expect(line.title).toContain(refusal.message);
    expect(a.dataset.refusals).toBe('6');
    expect(b.querySelector<HTMLElement>('.jp-StepwiseRefusals')!.hidden).toBe(true);
    expect(b.querySelector<HTMLElement>('li.jp-StepwiseRun')!.dataset.refused).toBe('0');

    await model.update(); // none any more: the line goes, the same row
    expect(rows(node)[0]).toBe(a);
    expect(line.hidden).toBe(true);
    expect(a.querySelector('.jp-StepwiseRun-steps')!.textContent).toBe('3 steps');
    model.dispose();
  });

  it('names the engine worker a session lives on, when the backend has workers', async () => {
    const { node, model } = await drawn([report([session('a', { worker: 'worker-1' }), session('b')])]);
    const [onWorker, inProcess] = rows(node);
    expect(text(onWorker, 'worker')).toBe('on worker-1');
    expect(onWorker.querySelector<HTMLElement>('.jp-StepwiseSession-worker')!.hidden).toBe(false);
    expect(inProcess.querySelector<HTMLElement>('.jp-StepwiseSession-worker')!.hidden).toBe(true);
    model.dispose();
  });

  it('shows the loss per token, and a last step that was skipped as skipped (issue 56)', async () => {
    const base = { base_model: 'HuggingFaceTB/SmolLM2-135M-Instruct', lora_rank: 8 };
    const runs = [
      // an RL run: step 6 tied (an optim_step with no forward_backward), its loss is step 5's
      { ...base, training_run_id: 'a:train:0', steps: 6, last_loss: -174.0, loss_step: 5, loss_per_token: 0.04712,
        skipped_steps: 1 },
      { ...base, training_run_id: 'a:train:1', steps: 3, last_loss: 25.79, loss_step: 3, loss_per_token: 0.047,
        skipped_steps: 0 },
      // a custom loss: no per-token figure, so the sum, said to be one
      { ...base, training_run_id: 'a:train:2', steps: 2, last_loss: 25.79, loss_step: 2, loss_per_token: null,
        skipped_steps: 0 }
    ];
    const { node, model } = await drawn([report([session('a', { runs })])]);
    const [row] = rows(node);
    expect(runTexts(row)).toEqual([
      'train:0 · 6 steps (1 skipped) · loss/token 0.04712 at step 5',
      'train:1 · 3 steps · loss/token 0.04700',
      'train:2 · 2 steps · summed loss 25.79'
    ]);
    const items = Array.from(row.querySelectorAll<HTMLElement>('li.jp-StepwiseRun'));
    expect(items.map(i => i.dataset.skipped)).toEqual(['1', '0', '0']);
    const tooltip = items[0].querySelector<HTMLElement>('.jp-StepwiseRun-loss')!.title;
    expect(tooltip).toContain('loss:sum -174');
    expect(tooltip).toContain('1 step skipped: an optim_step with no forward_backward before it');
    expect(row.textContent).not.toMatch(/(^|[^/])loss -174/); // never an unlabelled sum
    model.dispose();
  });

  it('calls a session by the name given to connect(), not its notebook (issue 56)', async () => {
    const named = session('a', { display_name: 'warehouse-agent', notebook: 'work/agent.ipynb',
                                 user_metadata: { name: 'warehouse-agent', local_pid: '12' } });
    const plain = session('b', { display_name: 'agent.ipynb', notebook: 'work/renamed.ipynb', user_metadata: {} });
    const { node, model } = await drawn([report([named, plain])]);
    const [a, b] = rows(node);
    expect(text(a, 'title')).toBe('warehouse-agent');
    expect(a.dataset.name).toBe('warehouse-agent');
    expect(a.dataset.notebook).toBe('work/agent.ipynb');
    expect(a.querySelector<HTMLElement>('.jp-StepwiseSession-header')!.title).toContain(
      'named by workbench.connect(name=...); its notebook is work/agent.ipynb');
    expect(text(b, 'title')).toBe('renamed.ipynb'); // no name given: the notebook's, after a rename too
    model.dispose();
  });

  it('says what each total in the header covers (issue 56)', async () => {
    const running = { ...emptyRunning(), sessions: 2, cost: 0.00427, train_tokens: 1500 };
    const lab = { ...emptyLab(), since: '2026-12-05T23:40:12+00:00', sessions: 6, cost: 0.00449 };
    const answer = report([session('a'), session('b')], { running, lab });
    const { node, model } = await drawn([answer, answer]);
    const part = (name: string) => node.querySelector<HTMLElement>(`.jp-StepwiseSidebar-${name}`)!;
    expect(part('count').textContent!.trim()).toBe('2 sessions · 2 running');
    expect(part('running').textContent).toBe('running sessions $0.00427');
    expect(part('running').querySelector('.jp-StepwiseSidebar-amount')!.textContent).toBe('$0.00427');
    expect(part('running').title).toBe('What the 2 running sessions spent so far (ended sessions not counted): 1.5k tokens');
    expect(part('lab').textContent).toBe('lab since 23:40 UTC $0.00449');
    const lines = node.querySelector('.jp-StepwiseSidebar-summary')!.children;
    await model.update(); // the next poll updates the same lines in place
    expect(node.querySelector('.jp-StepwiseSidebar-summary')!.children[1]).toBe(lines[1]);
    expect(part('lab').title).toBe(
      'What every session created since 2026-12-05 23:40 UTC spent, ended ones included: 6 sessions, 0 tokens');
    model.dispose();
  });
});
