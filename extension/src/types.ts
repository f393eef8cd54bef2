/**
 * The report `GET /stepwise/sessions` answers (workbench/lab/backends.py): every session of every
 * running backend and those this lab remembers from backends that stopped, the totals of the active
 * ones, and why there may be nothing to show.
 */

export type Kind = 'prefill' | 'sample' | 'train';

export interface ICheckpoint {
  tinker_path: string;
  checkpoint_type: string;
  time: string;
  training_run_id: string;
}

/** An in-memory sampler (save_weights_and_get_sampling_client): no tinker:// path, gone with its backend. */
export interface ISnapshot {
  sampler_id: string;
  training_run_id: string;
  time: string;
}

/**
 * A budget as the backend counts it (kernel_backend/service/budgets.py): the most a session or a training run
 * may spend, what was spent against it, and its state. The state is the source of truth for colours:
 * "warning" from 80% spent, "exhausted" when the backend refuses more work (all spent, or too little
 * left for the work asked).
 */
export interface IBudget {
  scope: 'session' | 'run' | 'key' | 'tenant' | string;
  target: string;
  budget_usd: number | null;
  budget_tokens: number | null;
  spent_usd: number;
  spent_tokens: number;
  /** Admitted and still running: counted against the budget until it is billed. */
  pending_usd: number;
  /** Spent / budget, the larger of money and tokens. */
  fraction: number;
  state: BudgetState;
}

export type BudgetState = 'ok' | 'warning' | 'exhausted';

/** A request the server refused (a budget's 402, a rate limit's 429), with the server's own words. */
export interface IRefusal {
  status: number;
  request_type: string;
  /** e.g. "tenant 'alice' budget of $0.0010 is spent ($0.0012 of it); ..." */
  message: string;
  /** ISO time. */
  at: string;
}

/** One training run of a session: its own steps and last loss. */
export interface IRun {
  training_run_id: string;
  base_model: string;
  lora_rank: number;
  steps: number;
  /** The newest forward_backward's loss:sum (summed over tokens, as Tinker's losses are). */
  last_loss: number | null;
  /** The step that loss belongs to (optimizer steps before it, plus one), and its loss per token (the step's
   * loss:sum over the tokens its loss counts, as the notebooks print it); null where the backend cannot say. */
  loss_step?: number | null;
  loss_per_token?: number | null;
  /** Optimizer steps taken with no forward_backward sent before them (an RL step whose groups all tied). */
  skipped_steps?: number;
  /** Optimizer steps whose forward_backward the server refused (not counted in skipped_steps): they had no
   * gradient. An unawaited forward_backward's refusal is otherwise seen nowhere. */
  refused_steps?: number;
  last_refusal?: IRefusal | null;
  /** A fork: the run it branched off and the step it started from (null for a run made from scratch). */
  parent_run_id?: string | null;
  fork_step?: number | null;
  /** The user's own, its name ("name") among them. */
  user_metadata?: Record<string, string>;
  cost?: number;
  /** Null (or absent, from a backend before budgets) when the run has none. */
  budget?: IBudget | null;
}

export interface ISession {
  session_id: string;
  /** 'ended' / 'unreachable': remembered by the lab after its backend stopped / stopped answering. */
  status: 'active' | 'finished' | 'expired' | 'ended' | 'unreachable' | string;
  created_at: string;
  age_s: number;
  /** The name it was given when its kernel connected (the notebook's name then). */
  display_name: string | null;
  /** The user's own; "name" when workbench.connect(name=...) named it (absent from a backend before this). */
  user_metadata?: Record<string, string>;
  /** The path of the notebook its kernel runs now (it follows a rename), when the lab knows it. */
  notebook?: string | null;
  /** Not read from its backend in this poll: the last row the lab saw. */
  remembered?: boolean;
  base_model: string | null;
  lora_rank: number | null;
  training_run_ids: string[];
  runs: IRun[];
  prefill_tokens: number;
  sample_tokens: number;
  train_tokens: number;
  cost: number;
  checkpoints: ICheckpoint[];
  sampler_snapshots: ISnapshot[];
  backend: string;
  /** The engine worker its first run lives on, when the backend runs Ray workers (kernel_backend/execution/cluster.py). */
  worker?: string | null;
  /** Null (or absent, from a backend before budgets) when the session has none. */
  budget?: IBudget | null;
  /** The session's requests the server refused (budget 402, rate limit 429) and the newest; null when none. */
  refusals?: { count: number; last: IRefusal } | null;
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
  /** Nothing listens at its address any more (its sessions show as 'unreachable'); a slow one is not stopped. */
  stopped?: boolean;
  /** Its tenant's budget (the top-level budget of its own report), where the lab passes it on per backend. */
  budget?: IBudget | null;
}

export interface IReport {
  sessions: ISession[];
  running: IRunning;
  lab: ILab;
  backends: IBackend[];
  currency: string;
  runtime_dir: string;
  message: string | null;
  /** The tenant's budget (every session of the tenant counts against it); null or absent when it has none. */
  budget?: IBudget | null;
}
