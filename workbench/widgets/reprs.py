"""Step-through display: rich HTML for the tinker SDK's results, registered as IPython formatters.

After `workbench.enable_reprs()` (connect() calls it) a cell ending in

    fb = tc.forward_backward(data, "cross_entropy").result(); fb
    tc.save_weights_and_get_sampling_client().sample(prompt, 2, params).result()

shows the loss and, per datum, each target token's text shaded by its logprob (prompt tokens, whose
weight is 0, dimmed) with the weighted sum that makes `loss:sum`; or each sample's text, tokens and
logprobs. The results carry no tokens or tokenizer: workbench/client/sdk_hooks.py remembers the calls that
produced them, so the datums come from there, and the tokenizer from the training client, or the
base model's local tokenizer for a sampler. `enable_reprs(tokenizer=...)` sets one explicitly.
The HTML builders are plain functions (tested directly).
"""

from __future__ import annotations

import functools
import html

import numpy as np

from workbench.client import sdk_hooks
from workbench.widgets.tokens import legend_html, local_tokenizer, token_html, token_pieces

MAX_ROWS = 8  # datums / sequences shown; the rest are counted
MAX_TOKENS = 96  # tokens shown per row

_tokenizer = None  # set by enable_reprs(tokenizer=...)

# `.wb-repr table.wb-t td`: more specific than JupyterLab's right-aligned
# `:not(.jp-RenderedMarkdown).jp-RenderedHTMLCommon td`.
_STYLE = ("<style>.wb-repr table.wb-t{border-collapse:collapse;font-size:12px}"
          ".wb-repr table.wb-t td,.wb-repr table.wb-t th{border:1px solid #ddd;padding:2px 6px;text-align:left;"
          "vertical-align:top}.wb-repr .wb-muted{color:#777}</style>")


def _metrics_table(metrics: dict) -> str:
    cells = "".join(f"<tr><th>{html.escape(k)}</th><td>{v:.6g}</td></tr>" for k, v in sorted(metrics.items()))
    return f'<table class="wb-t">{cells}</table>' if cells else ""


def _more(total: int, shown: int, what: str) -> str:
    return f'<div class="wb-muted">… {total - shown} more {what}</div>' if total > shown else ""


def _array(value) -> np.ndarray:
    return (value.to_numpy() if hasattr(value, "to_numpy") else np.asarray(value)).astype(float).ravel()


def _data_for(output) -> tuple[list | object | None, object]:
    """(the datums, the training client) of the recorded call whose shape matches `output`."""
    lengths = [_array(out["logprobs"]).size if "logprobs" in out else -1 for out in output.loss_fn_outputs]
    for call in sdk_hooks.recent_calls("forward_backward"):
        if [len(_array(d.loss_fn_inputs["target_tokens"])) for d in call.datums()] == lengths:
            return call.data, call.client
    return None, None


@functools.lru_cache(maxsize=8)
def _client_tokenizer(client):
    try:
        return client.get_tokenizer()
    except Exception:  # noqa: BLE001 - without a tokenizer the repr shows positions
        return None


def forward_backward_html(output, data=None, tokenizer=None, max_rows: int = MAX_ROWS,
                          max_tokens: int = MAX_TOKENS) -> str:
    """A ForwardBackwardOutput: the loss and metrics, then per datum its target tokens shaded by logprob.

    With the datums (given, or found among the recorded calls) each row shows the target tokens'
    text, dims the ones of weight 0 (the prompt), and sums weight × logprob: for cross_entropy,
    loss:sum is minus the total of that column. Without them, logprobs are shown by position."""
    client = None
    if data is None:
        data, client = _data_for(output)
    if tokenizer is None:
        tokenizer = _tokenizer or (_client_tokenizer(client) if client is not None else None)
    loss = output.metrics.get("loss:sum")
    head = "<b>ForwardBackwardOutput</b>"
    if loss is not None:
        head += f" &nbsp; loss:sum = <b>{loss:.6g}</b>"
    outputs = list(output.loss_fn_outputs)
    rows, weighted_total = [], 0.0
    for i, record in enumerate(outputs):
        logprobs = _array(record["logprobs"]) if "logprobs" in record else np.zeros(0)
        datum = data[i] if data is not None else None
        weights = (_array(datum.loss_fn_inputs["weights"]) if datum is not None and "weights" in datum.loss_fn_inputs
                   else np.ones_like(logprobs))
        weighted = float((weights * logprobs).sum()) if len(logprobs) == len(weights) else float("nan")
        weighted_total += weighted
        if i >= max_rows:
            continue
        shown = logprobs[:max_tokens]
        if datum is not None:
            targets = _array(datum.loss_fn_inputs["target_tokens"]).astype(int)[:max_tokens]
            pieces = token_pieces(targets, tokenizer)
        else:
            pieces = [f"{v:.2f} " for v in shown]
        cells = token_html(pieces, list(shown), "logprob", muted=[w == 0 for w in weights[:max_tokens]])
        if len(logprobs) > max_tokens:
            cells += f'<span class="wb-muted">… {len(logprobs) - max_tokens} more</span>'
        rows.append(f"<tr><td>{i}</td><td>{len(logprobs)}</td><td>{int((weights != 0).sum())}</td>"
                    f"<td>{weighted:.4g}</td><td>{logprobs.sum():.4g}</td><td>{cells}</td></tr>")
    what = "target tokens, by logprob (dimmed: weight 0)" if data is not None else (
        "per-position logprobs (the datums were not recorded: call through a connect()ed client for token text)")
    table = ('<table class="wb-t"><tr><th>datum</th><th>targets</th><th>weighted</th><th>Σ weight·logprob</th>'
             f"<th>Σ logprob (all)</th><th>{what}</th></tr>" + "".join(rows) + "</table>")
    check = ""
    if data is not None and outputs:
        check = (f'<div class="wb-muted">Σ over datums of Σ weight·logprob = {weighted_total:.6g}; for cross_entropy '
                 f"loss:sum is minus that (a sum over tokens, not a mean).</div>")
    return (f'<div class="wb-repr">{_STYLE}{head}{_metrics_table(output.metrics)}{table}'
            f"{_more(len(outputs), max_rows, 'datums')}{legend_html('logprob')}{check}</div>")


def _sampler_tokenizer(response):
    """The tokenizer of the sampler that produced `response` (recorded call, local model store)."""
    for call in sdk_hooks.recent_calls("sample"):
        if call.num_samples == len(response.sequences):
            try:
                return local_tokenizer(call.client.get_base_model())
            except Exception:  # noqa: BLE001 - a model this machine does not have: ids it is
                return None
    return None


def sample_html(response, tokenizer=None, max_rows: int = MAX_ROWS, max_tokens: int = MAX_TOKENS) -> str:
    """A SampleResponse: per sequence, the decoded text, then its tokens shaded by logprob."""
    tokenizer = tokenizer if tokenizer is not None else (_tokenizer or _sampler_tokenizer(response))
    sequences = list(response.sequences)
    blocks = []
    for i, seq in enumerate(sequences[:max_rows]):
        tokens = list(seq.tokens)
        logprobs = list(seq.logprobs) if seq.logprobs is not None else None
        text = tokenizer.decode(tokens) if tokenizer is not None else " ".join(map(str, tokens))
        shown = token_pieces(tokens[:max_tokens], tokenizer)
        spans = token_html(shown, logprobs[:max_tokens] if logprobs else None, "logprob")
        total = f" · Σ logprob {sum(logprobs):.4g}" if logprobs else ""
        blocks.append(
            f"<tr><td>{i}</td><td>{html.escape(str(seq.stop_reason))}</td><td>{len(tokens)}{total}</td>"
            f"<td><div style='white-space:pre-wrap'>{html.escape(text)}</div>{spans}"
            f"{_more(len(tokens), max_tokens, 'tokens')}</td></tr>"
        )
    hint = "" if tokenizer is not None else (
        '<div class="wb-muted">tokens shown as ids: workbench.enable_reprs(tokenizer=tc.get_tokenizer()) '
        "shows their text</div>")
    table = ('<table class="wb-t"><tr><th>#</th><th>stop</th><th>tokens</th><th>text, then tokens by logprob</th></tr>'
             + "".join(blocks) + "</table>")
    legend = legend_html("logprob") if any(seq.logprobs for seq in sequences) else ""
    return (f'<div class="wb-repr">{_STYLE}<b>SampleResponse</b> · {len(sequences)} sequence(s){table}'
            f"{_more(len(sequences), max_rows, 'sequences')}{legend}{hint}</div>")


def enable_reprs(shell=None, tokenizer=None) -> bool:
    """Register the HTML reprs with IPython (the current shell unless one is given).

    Returns False outside IPython (nothing to register with). `tokenizer` is remembered for
    decoding sampled tokens.
    """
    global _tokenizer
    from tinker import types

    if tokenizer is not None:
        _tokenizer = tokenizer
    if shell is None:
        try:
            from IPython import get_ipython
        except ImportError:
            return False
        shell = get_ipython()
    if shell is None:
        return False
    formatter = shell.display_formatter.formatters["text/html"]
    sdk_hooks.install()  # remember each call's datums, so results show their tokens
    formatter.for_type(types.ForwardBackwardOutput, forward_backward_html)
    formatter.for_type(types.SampleResponse, sample_html)
    return True
