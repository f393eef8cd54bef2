"""Step-through display: rich HTML for the tinker SDK's results, registered as IPython formatters.

After `workbench.enable_reprs()` (connect() calls it) a cell ending in

    fb = tc.forward_backward(data, "cross_entropy").result(); fb
    tc.save_weights_and_get_sampling_client().sample(prompt, 2, params).result()

shows the loss and a per-token logprob table, or each sample's text, tokens and logprobs, instead
of a dataclass dump. Token text needs a tokenizer: `enable_reprs(tokenizer=tc.get_tokenizer())`;
without one tokens show as ids. The HTML builders are plain functions (tested directly).
"""

from __future__ import annotations

import html

import numpy as np

from workbench.widgets.tokens import token_html, token_pieces

MAX_ROWS = 8  # datums / sequences shown; the rest are counted
MAX_TOKENS = 96  # tokens shown per row

_tokenizer = None  # set by enable_reprs(tokenizer=...)

_STYLE = ("<style>.wb-repr table{border-collapse:collapse;font-size:12px}"
          ".wb-repr td,.wb-repr th{border:1px solid #ddd;padding:2px 6px;text-align:left;vertical-align:top}"
          ".wb-repr .wb-muted{color:#777}</style>")


def _metrics_table(metrics: dict) -> str:
    cells = "".join(f"<tr><th>{html.escape(k)}</th><td>{v:.6g}</td></tr>" for k, v in sorted(metrics.items()))
    return f"<table>{cells}</table>" if cells else ""


def _more(total: int, shown: int, what: str) -> str:
    return f'<div class="wb-muted">… {total - shown} more {what}</div>' if total > shown else ""


def forward_backward_html(output, max_rows: int = MAX_ROWS, max_tokens: int = MAX_TOKENS) -> str:
    """A ForwardBackwardOutput: the loss and metrics, then each datum's target-token logprobs.

    The output carries no input tokens, so each logprob is shown by position, shaded by how
    unlikely the target token was (see tokens.token_color).
    """
    loss = output.metrics.get("loss:sum")
    head = "<b>ForwardBackwardOutput</b>"
    if loss is not None:
        head += f" &nbsp; loss:sum = <b>{loss:.6g}</b>"
    rows = []
    outputs = list(output.loss_fn_outputs)
    for i, record in enumerate(outputs[:max_rows]):
        logprobs = record["logprobs"].to_numpy().astype(float).ravel() if "logprobs" in record else np.zeros(0)
        shown = logprobs[:max_tokens]
        cells = token_html([f"{v:.2f} " for v in shown], list(shown), "logprob")
        if len(logprobs) > max_tokens:
            cells += f'<span class="wb-muted">… {len(logprobs) - max_tokens} more</span>'
        total = f"{logprobs.sum():.4g}" if len(logprobs) else "–"
        mean = f"{logprobs.mean():.4g}" if len(logprobs) else "–"
        rows.append(f"<tr><td>{i}</td><td>{len(logprobs)}</td><td>{total}</td><td>{mean}</td><td>{cells}</td></tr>")
    table = ("<table><tr><th>datum</th><th>targets</th><th>Σ logprob</th><th>mean</th>"
             "<th>per-token logprobs</th></tr>" + "".join(rows) + "</table>")
    return (f'<div class="wb-repr">{_STYLE}{head}{_metrics_table(output.metrics)}{table}'
            f"{_more(len(outputs), max_rows, 'datums')}</div>")


def sample_html(response, tokenizer=None, max_rows: int = MAX_ROWS, max_tokens: int = MAX_TOKENS) -> str:
    """A SampleResponse: per sequence, the decoded text, then its tokens shaded by logprob."""
    tokenizer = tokenizer if tokenizer is not None else _tokenizer
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
    table = ("<table><tr><th>#</th><th>stop</th><th>tokens</th><th>text, then tokens by logprob</th></tr>"
             + "".join(blocks) + "</table>")
    return (f'<div class="wb-repr">{_STYLE}<b>SampleResponse</b> · {len(sequences)} sequence(s){table}'
            f"{_more(len(sequences), max_rows, 'sequences')}{hint}</div>")


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
    formatter.for_type(types.ForwardBackwardOutput, forward_backward_html)
    formatter.for_type(types.SampleResponse, sample_html)
    return True
