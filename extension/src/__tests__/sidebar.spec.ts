/**
 * @jest-environment jsdom
 */
// The sidebar drawn from a model in a DOM: rows, their facts, expanding, copying, and updates in place.
// JupyterLab's clipboard and icon registry are stand-ins here; everything else is the real code.

import './jsdom-shims';

import { emptyLab, emptyRunning, SessionsModel } from '../model';
import { SessionsSidebar } from '../sidebar';
import { IReport, ISession } from '../types';

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
    steps: 3,
    last_loss: 12.3456,
    prefill_tokens: 0,
    sample_tokens: 20,
    train_tokens: 1500,
    cost: 0.000123,
    checkpoints: [],
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

describe('SessionsSidebar', () => {
  it('draws one row per session with its model, rank, steps, loss, tokens, cost and age', async () => {
    const { node, model } = await drawn([report([session('a')])]);
    const [row] = rows(node);
    expect(row.dataset.steps).toBe('3');
    expect(text(row, 'title')).toBe('a');
    expect(text(row, 'model')).toBe('SmolLM2-135M-Instruct');
    expect(text(row, 'rank')).toBe('LoRA r8');
    expect(text(row, 'steps')).toBe('3 steps');
    expect(text(row, 'loss')).toBe('loss 12.35');
    expect(text(row, 'train')).toBe('train 1.5k');
    expect(text(row, 'cost')).toBe('$0.000123');
    expect(text(row, 'age')).toBe('1m 15s');
    expect(node.querySelector('.jp-StepwiseSidebar-summary')!.textContent).toBe('1 session · 1 running · $0.000123 · lab $0.000456');
    model.dispose();
  });

  it('updates rows in place and keeps the sorted order', async () => {
    const { node, model } = await drawn([
      report([session('a')]),
      report([session('a', { steps: 4 }), session('b', { created_at: '2026-01-02T00:00:00Z' })])
    ]);
    const first = rows(node)[0];
    await model.update();
    expect(rows(node).map(r => r.dataset.sessionId)).toEqual(['b', 'a']);
    expect(rows(node)[1]).toBe(first); // the same element, not a redraw
    expect(text(first, 'steps')).toBe('4 steps');
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

  it('names the engine worker a session lives on, when the backend has workers', async () => {
    const { node, model } = await drawn([report([session('a', { worker: 'worker-1' }), session('b')])]);
    const [onWorker, inProcess] = rows(node);
    expect(text(onWorker, 'worker')).toBe('on worker-1');
    expect(onWorker.querySelector<HTMLElement>('.jp-StepwiseSession-worker')!.hidden).toBe(false);
    expect(inProcess.querySelector<HTMLElement>('.jp-StepwiseSession-worker')!.hidden).toBe(true);
    model.dispose();
  });
});
