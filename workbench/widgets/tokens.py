"""Per-token colouring: a completion as HTML spans shaded by logprob or by advantage.

Used by the rollout inspector and the step-through reprs. Plain functions returning HTML strings,
so they are easy to test and work in any front end that renders text/html.

    logprob:   clear when the model was sure of the token (p near 1), red as p falls to 0
    advantage: green for positive, red for negative, shaded by |value| / the largest |value|
    change:    the same diverging colours, for a change of logprob (a probe's after minus before)

`legend_html(mode, scale)` says that in the page, with swatches of the same colours; token_html
adds it under the tokens with `legend=True`.
"""

from __future__ import annotations

import functools
import html
import math
from typing import Iterable, Sequence, SupportsInt

MAX_ALPHA = 0.85  # keep the text readable on the strongest colour
RED, GREEN = (220, 40, 40), (30, 160, 60)
DIVERGING = ("advantage", "change")  # modes coloured red below 0, green above


@functools.lru_cache(maxsize=4)
def local_tokenizer(base_model: str | None = None):
    """The base model's tokenizer from this machine's model store (where the local backend keeps it).

    TrainingClient.get_tokenizer() asks the backend where its tokenizer is; SamplingClient.get_tokenizer()
    looks the name up on the Hugging Face hub, which fails offline, so use this with a sampling client.
    Raises for a model this machine does not have."""
    from transformers import AutoTokenizer

    from kernel_backend.engine import base_models
    from kernel_backend.config import Settings

    return AutoTokenizer.from_pretrained(base_models.resolve(base_model or base_models.DEFAULT_MODEL, Settings().models_dir)[1])


def token_pieces(token_ids: Iterable[SupportsInt], tokenizer=None) -> list[str]:
    """Each token's text (decoded one by one), or `<id>` when there is no tokenizer."""
    if tokenizer is None:
        return [f"<{int(t)}>" for t in token_ids]
    return [tokenizer.decode([int(t)]) for t in token_ids]


def token_color(value: float | None, mode: str = "logprob", scale: float = 1.0) -> str | None:
    """The CSS background for one token, or None for no colour (value missing or not finite)."""
    if value is None or not math.isfinite(value):
        return None
    if mode == "logprob":
        alpha, rgb = 1.0 - math.exp(min(value, 0.0)), RED  # 1 - p: how surprised the model was
    elif mode in DIVERGING:
        alpha, rgb = min(abs(value) / scale, 1.0) if scale > 0 else 0.0, GREEN if value >= 0 else RED
    else:
        raise ValueError(f"unknown colour mode {mode!r}; use 'logprob', 'advantage' or 'change'")
    return f"rgba({rgb[0]},{rgb[1]},{rgb[2]},{alpha * MAX_ALPHA:.3f})"


def _swatch(color: str | None, label: str) -> str:
    fill = f"background-color:{color};" if color else ""
    return (f'<span class="wb-swatch" style="{fill}border:1px solid #ccc;padding:0 4px;margin:0 2px">'
            f"{html.escape(label)}</span>")


def legend_html(mode: str = "logprob", scale: float = 1.0) -> str:
    """What the colours of `mode` mean, with swatches drawn by token_color itself (so they cannot
    drift from the tokens'); `scale` is the |advantage| shown at full colour."""
    if mode == "logprob":
        swatches = [_swatch(token_color(math.log(p), mode), label) for p, label in
                    ((1.0, "p ≈ 1"), (0.5, "p = 0.5"), (0.1, "p = 0.1"), (1e-4, "p ≈ 0"))]
        meaning = "how unlikely the model found each token (red = 1 − p)"
    elif mode in DIVERGING:
        swatches = [_swatch(token_color(v, mode, scale), label) for v, label in
                    ((-scale, f"−{scale:.3g}"), (-scale / 2, f"−{scale / 2:.3g}"), (0.0, "0"),
                     (scale / 2, f"+{scale / 2:.3g}"), (scale, f"+{scale:.3g}"))]
        what = "advantage" if mode == "advantage" else "logprob change"
        meaning = f"red below 0, green above, full colour at ±{scale:.3g} (the largest |{what}| here)"
    else:
        raise ValueError(f"unknown colour mode {mode!r}; use 'logprob', 'advantage' or 'change'")
    return (f'<div class="wb-legend" data-mode="{mode}" style="font:11px sans-serif;color:#555;margin:4px 0">'
            f"<b>colour = {mode}</b>: {html.escape(meaning)} &nbsp;{''.join(swatches)}"
            " &nbsp;(hover a token for its value)</div>")


def token_html(tokens: Sequence[str], values: Sequence[float | None] | None, mode: str = "logprob",
               muted: Sequence[bool] | None = None, legend: bool = False) -> str:
    """`tokens` as <span>s coloured by `values` (one per token; None leaves a token plain).

    Each span's title shows the value, so hovering a token tells its logprob or advantage.
    `muted` tokens (e.g. a prompt's, of weight 0) are drawn faded. With `legend`, what the colours
    mean follows (legend_html, at the scale used here), when any token is coloured.
    """
    values = list(values) if values is not None else [None] * len(tokens)
    if len(values) != len(tokens):
        raise ValueError(f"{len(tokens)} tokens but {len(values)} values")
    finite = [abs(v) for v in values if v is not None and math.isfinite(v)]
    scale = max(finite, default=1.0) or 1.0  # advantage, change: the largest magnitude is full colour
    spans = []
    muted = list(muted) if muted is not None else [False] * len(tokens)
    for text, value, faded in zip(tokens, values, muted + [False] * (len(tokens) - len(muted))):
        color = token_color(value, mode, scale)
        css = (f"background-color:{color};" if color else "") + ("opacity:0.45;" if faded else "")
        style = f' style="{css}"' if css else ""
        title = f' title="{mode} {value:.4f}"' if value is not None and math.isfinite(value) else ""
        spans.append(f'<span class="wb-tok"{style}{title}>{html.escape(text)}</span>')
    shown = legend_html(mode, scale) if legend and finite else ""
    return ('<div class="wb-tokens" style="white-space:pre-wrap;font-family:monospace;line-height:1.6">'
            + "".join(spans) + "</div>" + shown)
