"""Budgets: the most money (and, optionally, tokens) a session, a training run, an API key or a tenant may spend.

Who sets them:
- a session's: `ServiceClient(user_metadata={"budget_usd": "0.50"})` (also "budget_tokens"), when it is made;
- a training run's: `create_lora_training_client(..., user_metadata={"budget_usd": "0.20"})`;
- any of them later, and an API key's: PUT /api/v1/budgets/{scope}/{target} (kernel_backend/api/budgets.py);
- a tenant's (all its keys and sessions together): the operator, on that route.

How they count (the same way the token limits in service/admission.py do): when a request is admitted, its
upper-bound cost is priced (a sample at max_tokens for every sample; a forward_backward exactly, from
its datums) and added to what is in flight; the request is refused if spent (the ledger) + in flight +
this request would pass any budget that covers it. Refused: `OverBudget`, HTTP 402, before anything is
queued, so nothing changes. Admitted work finishes and is billed exactly (the ledger row), and its
in-flight bound is released only once that row is written, so there is no moment where a request
counts nowhere. Spend therefore never passes a budget, even with many requests in flight.

Scopes and what each counts (`ledger_scope`): a session its requests (the OpenAI and Anthropic routes'
requests count in the client's own session, service/sessions.client_session, not the one that made the
checkpoint they sample); a run its own requests plus the sampling done with its weights (its rollouts, the
OpenAI routes' samples of its checkpoints too); a key every request sent with it; a tenant all of its requests.
"""

from __future__ import annotations

import math
import threading
from contextvars import ContextVar
from dataclasses import dataclass

from sqlalchemy import func, or_, select

from kernel_backend.persistence.database import BudgetRow, SamplerRow, Store, UsageRow, now
from kernel_backend.errors import OverBudget, UserError

SCOPES = ("session", "run", "key", "tenant")
# The share of a budget past which it is shown as nearly spent (the sidebar's and the status bar's amber).
WARNING_FRACTION = 0.8
# Far above any real budget, small enough to stay an exact float.
MAX_USD = 1e9
MAX_TOKENS = 10**15
# Prices are floats: a cost within this of the budget fits.
EPSILON_USD = 1e-9

# The API key (its prefix) of the request being served. The app's middleware puts a fresh holder in each
# request's context and the auth dependency fills it in (kernel_backend/api/auth.py): a dependency runs in a
# copy of the context, so it fills in a shared holder rather than setting the variable itself.
_request_key: ContextVar[dict | None] = ContextVar("stepwise_request_key", default=None)


def new_request_holder() -> None:
    _request_key.set({})


def set_request_key(prefix: str) -> None:
    holder = _request_key.get()
    if holder is not None:
        holder["key"] = prefix


def request_key() -> str | None:
    holder = _request_key.get()
    return holder.get("key") if holder else None


def note(**fields) -> None:
    """Add to what the request's log line says (kernel_backend/api/monitoring.py): its tenant, the tokens admitted."""
    holder = _request_key.get()
    if holder is not None:
        holder.update(fields)


def notes() -> dict:
    """What the request being served was noted with: its key's prefix ("key"), "tenant", "tokens"."""
    return dict(_request_key.get() or {})


@dataclass
class Scopes:
    """What a request is charged to: the budgets that may refuse it."""

    tenant: str
    session_id: str | None = None
    run_id: str | None = None
    key: str | None = None

    def pairs(self) -> list[tuple[str, str]]:
        return [(scope, target) for scope, target in (("session", self.session_id), ("run", self.run_id),
                                                      ("key", self.key), ("tenant", self.tenant)) if target]


def parse_limits(usd, tokens, where: str) -> tuple[float | None, int | None]:
    """A budget's money and tokens from user input (numbers or numeric strings; None: no limit of that kind)."""
    return _limit(usd, f"{where} budget_usd", MAX_USD, False), _limit(tokens, f"{where} budget_tokens", MAX_TOKENS, True)


def _limit(value, name: str, high: float, whole: bool):
    if value is None or value == "":
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or not math.isfinite(number) or not 0 <= number <= high or (whole and not number.is_integer()):
        kind = "a whole number" if whole else "a number"
        raise UserError(f"{name} must be {kind} from 0 to {high:g}, got {value!r}")
    return int(number) if whole else number


def from_metadata(tenant: str, scope: str, target: str, user_metadata: dict | None) -> BudgetRow | None:
    """The budget a session's or run's user_metadata asks for ({"budget_usd": "0.5", "budget_tokens": ...})."""
    metadata = user_metadata or {}
    if "budget_usd" not in metadata and "budget_tokens" not in metadata:
        return None
    usd, tokens = parse_limits(metadata.get("budget_usd"), metadata.get("budget_tokens"), "user_metadata")
    return BudgetRow(tenant=tenant, scope=scope, target=target, usd=usd, tokens=tokens)


def samplers_of_run(tenant: str, training_run_id: str):
    """The ids of the samplers that sample `training_run_id`'s weights (a subquery): its in-memory
    snapshots (save_weights_and_get_sampling_client) and samplers of its checkpoints
    (tinker://<run>/sampler_weights/... or weights/...). Usage rows of sampling name the sampler,
    not the run, so this is how a run's rollouts are found."""
    return select(SamplerRow.id).where(SamplerRow.tenant == tenant, or_(
        SamplerRow.source_model_id == training_run_id,
        # autoescape: a run id's "_" or "%" is itself, not a LIKE wildcard
        SamplerRow.model_path.startswith(f"tinker://{training_run_id}/", autoescape=True)))


def ledger_scope(tenant: str, scope: str, target: str) -> list:
    """The ledger rows a scope covers, as WHERE clauses on UsageRow."""
    if scope == "session":
        return [UsageRow.tenant == tenant, UsageRow.session_id == target]
    if scope == "run":  # its own requests, its rollouts, and the OpenAI routes' sampling of its checkpoints
        return [UsageRow.tenant == tenant, or_(
            UsageRow.model_id == target, UsageRow.sampler_id.in_(samplers_of_run(tenant, target)),
            UsageRow.sampler_id.startswith(f"oai:{tenant}:tinker://{target}/", autoescape=True))]
    if scope == "key":
        return [UsageRow.tenant == tenant, UsageRow.api_key == target]
    return [UsageRow.tenant == target]


class Budgets:
    """Admits requests against the budgets that cover them, and reports those budgets."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._lock = threading.Lock()
        # request id -> (the budgets' (scope, target) it counts against, its bound in USD, in tokens), until its
        # ledger row is written.
        self._in_flight: dict[str, tuple[list[tuple[str, str]], float, int]] = {}
        self._refused: set[tuple[str, str]] = set()  # budgets that refused a request since they were last set

    def covering(self, scopes: Scopes) -> list[BudgetRow]:
        pairs = scopes.pairs()
        with self.store.session() as s:
            rows = s.scalars(select(BudgetRow).where(
                or_(*[(BudgetRow.scope == scope) & (BudgetRow.target == target) for scope, target in pairs])))
            # A tenant budget is the operator's; the others must be the caller's own.
            return [row for row in rows if row.scope == "tenant" or row.tenant == scopes.tenant]

    def admit(self, request_id: str, scopes: Scopes, cost: float, tokens: int) -> None:
        """Count a request's upper bound (`cost` USD, `tokens`) against every budget covering it, or raise OverBudget."""
        budgets = self.covering(scopes)
        if not budgets:
            return
        with self._lock:
            for budget in budgets:
                spent_usd, spent_tokens = self.spent(budget)
                pending_usd, pending_tokens = self._pending(budget)
                refusal = None
                if budget.usd is not None and spent_usd + pending_usd + cost > budget.usd + EPSILON_USD:
                    refusal = _refusal(budget, usd(budget.usd), usd(spent_usd), usd(pending_usd), usd(cost))
                elif budget.tokens is not None and spent_tokens + pending_tokens + tokens > budget.tokens:
                    refusal = _refusal(budget, f"{budget.tokens:,} tokens", f"{spent_tokens:,} tokens",
                                       f"{pending_tokens:,} tokens", f"{tokens:,} tokens")
                if refusal:
                    self._refused.add((budget.scope, budget.target))
                    raise OverBudget(refusal)
            self._in_flight[request_id] = ([(b.scope, b.target) for b in budgets], cost, tokens)

    def release(self, request_id: str) -> None:
        """The request's ledger row is written (or it failed): its bound no longer counts."""
        with self._lock:
            self._in_flight.pop(request_id, None)

    def spent(self, budget: BudgetRow) -> tuple[float, int]:
        """USD and tokens the ledger holds for the budget's scope."""
        with self.store.session() as s:
            cost, tokens = s.execute(select(
                func.coalesce(func.sum(UsageRow.cost), 0.0),
                func.coalesce(func.sum(UsageRow.prefill_tokens + UsageRow.sample_tokens + UsageRow.train_tokens), 0),
            ).where(*ledger_scope(budget.tenant, budget.scope, budget.target))).one()
        return float(cost), int(tokens)

    def _pending(self, budget: BudgetRow) -> tuple[float, int]:
        mine = [(cost, tokens) for pairs, cost, tokens in self._in_flight.values() if (budget.scope, budget.target) in pairs]
        return sum(c for c, _ in mine), sum(t for _, t in mine)

    # ---- what the usage API, the sidebar and the status bar show -----------------------------------

    def report(self, budget: BudgetRow | None) -> dict | None:
        """A budget with what was spent, what is in flight, the fraction used and its state (ok, warning, exhausted)."""
        if budget is None:
            return None
        spent_usd, spent_tokens = self.spent(budget)
        with self._lock:
            pending_usd, _ = self._pending(budget)
        fractions = [spent / limit if limit else 1.0 for spent, limit in ((spent_usd, budget.usd),
                                                                         (spent_tokens, budget.tokens)) if limit is not None]
        fraction = max(fractions, default=0.0)
        # Exhausted: all spent, or a request was refused since the budget was last set (what is left is too
        # little for the work asked).
        exhausted = fraction >= 1 - 1e-9 or (budget.scope, budget.target) in self._refused
        return {
            "scope": budget.scope, "target": budget.target, "budget_usd": budget.usd, "budget_tokens": budget.tokens,
            "spent_usd": spent_usd, "spent_tokens": spent_tokens, "pending_usd": pending_usd,
            "fraction": fraction,
            "state": "exhausted" if exhausted else "warning" if fraction >= WARNING_FRACTION else "ok",
        }

    def get(self, scope: str, target: str) -> BudgetRow | None:
        with self.store.session() as s:
            return s.scalar(select(BudgetRow).where(BudgetRow.scope == scope, BudgetRow.target == target))

    def of_tenant(self, tenant: str) -> list[BudgetRow]:
        """A tenant's budgets: its own, and the operator's on the tenant as a whole."""
        with self.store.session() as s:
            return list(s.scalars(select(BudgetRow).where(or_(
                BudgetRow.tenant == tenant, (BudgetRow.scope == "tenant") & (BudgetRow.target == tenant)))
                .order_by(BudgetRow.id)))

    def set(self, tenant: str, scope: str, target: str, usd, tokens) -> BudgetRow:
        """Set (or replace) a budget; the caller checked that `tenant` may. Work in flight is not touched."""
        usd, tokens = parse_limits(usd, tokens, "the budget's")
        if usd is None and tokens is None:
            raise UserError("give budget_usd, budget_tokens or both (DELETE the budget to remove it)")
        with self.store.session.begin() as s:
            row = s.scalar(select(BudgetRow).where(BudgetRow.scope == scope, BudgetRow.target == target))
            if row is None:
                row = BudgetRow(tenant=tenant, scope=scope, target=target)
                s.add(row)
            row.usd, row.tokens, row.updated_at = usd, tokens, now()
        with self._lock:
            self._refused.discard((scope, target))
        return row

    def delete(self, scope: str, target: str) -> bool:
        with self.store.session.begin() as s:
            row = s.scalar(select(BudgetRow).where(BudgetRow.scope == scope, BudgetRow.target == target))
            if row is not None:
                s.delete(row)
            return row is not None


def _refusal(budget: BudgetRow, limit: str, spent: str, pending: str, cost: str) -> str:
    raise_it = (f"raise it with PUT /api/v1/budgets/{budget.scope}/{budget.target} {{\"budget_usd\": ...}} "
                "(workbench.set_budget(usd=...) from a notebook)")
    if budget.scope == "tenant":
        raise_it = "the server's operator can raise it (PUT /api/v1/budgets/tenant/...)"
    return (f"over budget: the budget of {budget.scope} {budget.target} is {limit}; {spent} spent and {pending} in "
            f"flight, and this request may cost up to {cost}. Nothing was run or billed; {raise_it}, then send it again")


def usd(amount: float) -> str:
    """Money as people read it, always in plain decimals: cents for real amounts, three significant digits for
    the tiny ones of a small model ($0.0000336, never $3.36e-05), and $0 for nothing."""
    if amount == 0:
        return "$0"
    if amount >= 0.01:
        return f"${amount:,.4f}"
    decimals = 2 - math.floor(math.log10(amount))
    return f"${amount:.{decimals}f}".rstrip("0")
