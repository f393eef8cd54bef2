/**
 * The report `GET /stepwise/sessions` answers (workbench/lab/backends.py): every session of every
 * running backend, the totals of the active ones, and why there may be nothing to show.
 */

export type Kind = 'prefill' | 'sample' | 'train';

export interface ICheckpoint {
  tinker_path: string;
  checkpoint_type: string;
  time: string;
  training_run_id: string;
}

export interface ISession {
  session_id: string;
  status: 'active' | 'finished' | 'expired' | string;
  created_at: string;
  age_s: number;
  display_name: string | null;
  base_model: string | null;
  lora_rank: number | null;
  training_run_ids: string[];
  steps: number;
  last_loss: number | null;
  prefill_tokens: number;
  sample_tokens: number;
  train_tokens: number;
  cost: number;
  checkpoints: ICheckpoint[];
  backend: string;
  /** The engine worker its first run lives on, when the backend runs Ray workers (kernel_backend/cluster.py). */
  worker?: string | null;
}

/** Sessions counted, their tokens by kind and their cost. */
export interface ITotals {
  sessions: number;
  prefill_tokens: number;
  sample_tokens: number;
  train_tokens: number;
  cost: number;
}

/** The active sessions of every backend, with the cost of each kind of token. */
export interface IRunning extends ITotals {
  by_kind: Record<Kind, { tokens: number; cost: number }>;
}

/** Every session created since the Jupyter server started, ended or not: it never falls. */
export interface ILab extends ITotals {
  since: string;
}

export interface IBackend {
  base_url: string;
  embedded: boolean;
  started: string;
  kernel_pids: number[];
  sessions: number;
  error: string | null;
}

export interface IReport {
  sessions: ISession[];
  running: IRunning;
  lab: ILab;
  backends: IBackend[];
  currency: string;
  runtime_dir: string;
  message: string | null;
}
