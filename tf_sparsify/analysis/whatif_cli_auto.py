"""``python -m tf_sparsify whatif --auto``: what Auto would send each tensor with, on this link.

The settings, from the least compression to the most: dense fp32, FP16, TopK at each of
``--auto-ratios`` (largest first). Their own costs come from ``--overhead-ms``: ``fp16=MS`` and
``topk=MS`` are one step's cost for the whole model, spread over its entries. The choice is
:func:`tf_sparsify.step_model.choice.choose` (backprop overlap, ``--late-buckets``, the
plan's buckets of its default size; with ``--host-work``, the exchange's host work that
``--link`` measured counts as compute).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence

from tf_sparsify.analysis.whatif_cli_tables import columns
from tf_sparsify.analysis.whatif_cli_values import OptionError
from tf_sparsify.common.checks import check_number
from tf_sparsify.compressors.auto import Auto
from tf_sparsify.step_model.buckets import DEFAULT_BUCKET_BYTES
from tf_sparsify.step_model.choice import Choice, Setting, auto_settings, choose
from tf_sparsify.step_model.network import Cluster
from tf_sparsify.step_model.shapes import Layers

AUTO_RATIOS = "0.01,0.001"


def auto_ratios(text: str) -> list[float]:
    """TopK densities from a comma list (each in (0, 1], each once), largest first."""
    expected = f"expected a comma list of TopK densities in (0, 1], e.g. {AUTO_RATIOS}"
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
        for value in values:
            check_number("ratio", value, 0, 1, low_open=True)
    except ValueError as error:
        raise OptionError(f"{text!r}: {expected}") from error
    if not values or len(set(values)) != len(values):
        raise OptionError(f"{text!r}: {expected}")
    return sorted(values, reverse=True)


def settings_for(
    ratios: Sequence[float], overheads: Mapping[str, float], num_params: int
) -> list[Setting]:
    """Dense, FP16, then TopK at each ratio; ``overheads``: ``{"fp16" | "topk": seconds}`` of
    one step for the ``num_params`` entries of the model."""
    fp16, topk = (overheads.get(name, 0.0) / num_params for name in ("fp16", "topk"))
    return auto_settings(Auto(ratios), [0.0, fp16, *(topk for _ in ratios)])


def _ranges(indices: Sequence[int]) -> str:
    """``0-3, 7`` for ``[0, 1, 2, 3, 7]``."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def auto_table(choice: Choice, settings: Sequence[Setting], layers: Layers) -> str:
    """A row per setting Auto uses: how many tensors and parameters, which tensors (0 is the
    first layer's); then the predicted step and whether the exchange hides."""
    rows = [("setting", "tensors", "parameters", "which (0: first layer)")]
    for level, setting in enumerate(settings):
        mine = [i for i, lv in enumerate(choice.levels) if lv == level]
        if mine:
            params = sum(layers.sizes[i] for i in mine)
            rows.append((setting.name, str(len(mine)), f"{params:,}", _ranges(mine)))
    head, *body = columns(rows, (10, 9, 13, 24), left=1)
    hides = "hides under compute" if choice.hidden else "partly exposed"
    summary = (
        f"auto: {1e3 * choice.step:.1f} ms/step (compute {1e3 * choice.compute:.1f}, "
        f"compression {1e3 * choice.overhead:.1f}); the exchange {hides}"
    )
    return "\n".join([head, "-" * len(head), *body, summary])


def run_auto(args: argparse.Namespace, layers: Layers, cluster: Cluster) -> str:
    """The ``--auto`` section of ``run_once``'s output."""
    settings = settings_for(args.auto_ratio_list, args.overhead_ms, layers.num_params)
    choice = choose(
        layers,
        settings,
        cluster,
        args.compute_ms / 1e3,
        late_buckets=args.late_buckets,
        host=args.link_host if args.host_work else None,
        bucket_bytes=DEFAULT_BUCKET_BYTES,
    )
    return auto_table(choice, settings, layers)
