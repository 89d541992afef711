"""TopK in practice: the norm gap against K and convergence against K (paper A, Figures 2 and 3).

Alistarh et al. (NeurIPS 2018) observe that on real gradients the norm gap
``||x - TopK(x)|| / ||x||`` stays far below its worst case ``sqrt(1 - K/n)`` (their Figure 2)
and that with error feedback K as small as 0.1%-1% of n still trains (Figure 3). This script
measures both on data shipped with scikit-learn (no download):

* ``mlp``: digits (8x8 images, 10 classes), a 64-256-10 ReLU network, n = 19,210;
* ``logreg``: digits, multinomial logistic regression, n = 650.

For every task and K in {0.1%, 1%, 10%, 100%}, with and without error feedback, it trains with
plain SGD through :class:`tf_sparsify.SparsifiedOptimizer` (TopK over the whole gradient,
``scope="global"``; K = 100% is the uncompressed ``Identity``), records the norm gap every few
steps with :class:`tf_sparsify.CompressionDiagnostics` and the bytes with
:class:`tf_sparsify.CompressionStats`, and runs a few more K for the norm-gap curve. With
``--dgc`` it adds, on the MLP, DGC's heuristics at K = 0.1% (momentum correction 0.9, local
clipping, density warm-up) against dense SGD with momentum 0.9. For accuracy against bytes it
also trains with :class:`tf_sparsify.PowerSGD` of rank 1, 2 and 4 (rank 1 with ``--quick``),
per layer, with error feedback.

Outputs (under ``--out``, default ``outputs/topk_study``): ``results.json``, ``table.md``,
``norm_gap_vs_k.png``, ``convergence.png``, ``accuracy_vs_bytes.png`` and one diagnostics PNG.

    python examples/topk_study.py                 # both tasks, 20 epochs: ~3 min on 2 cores
    python examples/topk_study.py --quick         # 4 epochs, fewer K: under a minute
    python examples/topk_study.py --replicas 2    # 2 simulated workers (MirroredStrategy)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np

CONVERGENCE_K = (0.001, 0.01, 0.1, 1.0)
EXTRA_GAP_K = (0.003, 0.03, 0.3)
POWERSGD_RANKS = (1, 2, 4)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", default="mlp,logreg", help="comma list of mlp, logreg")
    p.add_argument("--epochs", type=int, default=None, help="20 (4 with --quick)")
    p.add_argument("--gap-epochs", type=int, default=None, help="epochs of the extra-K runs")
    p.add_argument("--batch-size", type=int, default=32, help="global batch size")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--every", type=int, default=10, help="diagnostics every N steps")
    p.add_argument("--dgc", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--quick", action="store_true", help="4 epochs, no extra K, no DGC runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="outputs/topk_study")
    args = p.parse_args(argv)
    if args.quick:
        args.dgc = False
    args.epochs = args.epochs or (4 if args.quick else 20)
    args.gap_epochs = args.gap_epochs or (0 if args.quick else args.epochs)
    args.task_list = [t for t in args.tasks.split(",") if t]
    bad = [t for t in args.task_list if t not in ("mlp", "logreg")]
    if bad or args.epochs < 1 or args.replicas < 1 or args.every < 1:
        p.error(f"bad arguments (unknown tasks {bad}?)")
    return args


def load_digits_split(seed: int):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    return train_test_split(x, y.astype("int64"), test_size=0.2, random_state=seed, stratify=y)


def build_model(keras, task: str):
    layers = [keras.Input((64,))]
    if task == "mlp":
        layers.append(keras.layers.Dense(256, activation="relu"))
    layers.append(keras.layers.Dense(10))
    return keras.Sequential(layers)


def run(cfg: dict, data, args, strategy) -> dict:
    """Train one configuration; return its curves, bytes and diagnostics."""
    import keras

    import tf_sparsify as tfs

    x_tr, x_te, y_tr, y_te = data
    keras.utils.set_random_seed(args.seed)
    with strategy.scope():
        model = build_model(keras, cfg["task"])
        inner = keras.optimizers.SGD(args.lr, momentum=cfg.get("inner_momentum", 0.0))
        options = cfg.get("options", {})
        scope = cfg.get("scope", "global")
        opt = tfs.SparsifiedOptimizer(
            inner, compressor_of(tfs, cfg), error_feedback=cfg["ef"], scope=scope, **options
        )
        model.compile(
            opt,
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    diag = tfs.CompressionDiagnostics(every_n_steps=args.every)
    callbacks = [tfs.CompressionStats(), diag]
    if cfg.get("warmup"):
        callbacks.insert(0, tfs.DensityWarmup(tfs.dgc_density_schedule(cfg["k"])))
    start = time.perf_counter()
    hist = model.fit(
        x_tr,
        y_tr,
        batch_size=args.batch_size,
        epochs=cfg["epochs"],
        validation_data=(x_te, y_te),
        verbose=0,
        callbacks=callbacks,
    ).history
    wall = time.perf_counter() - start
    n = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
    half = diag.records[len(diag.records) // 2 :]  # second half of training: past the transient
    gaps = [r["norm_gap"] for r in half]
    fresh = [r["grad_norm_gap"] for r in half]
    return {
        **{key: cfg[key] for key in ("task", "k", "ef", "label", "epochs")},
        "rank": cfg.get("rank"),
        "n": n,
        "loss": hist["loss"],
        "val_accuracy": hist["val_accuracy"],
        "bytes_per_step": hist["bytes_per_step"],
        "dense_bytes_per_step": hist["dense_bytes_per_step"][-1],
        "cumulative_bytes": hist["cumulative_bytes"],
        "norm_gap_mean": float(np.mean(gaps)),
        "norm_gap_min": float(np.min(gaps)),
        "norm_gap_max": float(np.max(gaps)),
        "grad_gap_mean": float(np.mean(fresh)),
        "grad_gap_min": float(np.min(fresh)),
        "grad_gap_max": float(np.max(fresh)),
        "norm_gap_bound": diag.records[-1].get("norm_gap_bound", 0.0),
        "residual_norm_last": diag.records[-1]["residual_norm"],
        "grad_norm_last": diag.records[-1]["grad_norm"],
        "wall_s": wall,
        "records": diag.records,
    }


def compressor_of(tfs, cfg: dict):
    """PowerSGD of the run's rank, else TopK at K (``Identity`` at 100%)."""
    if cfg.get("rank"):
        return tfs.PowerSGD(cfg["rank"])
    return tfs.Identity() if cfg["k"] >= 1.0 else tfs.TopK(ratio=cfg["k"])


def configs(args) -> list[dict]:
    out = []
    for task in args.task_list:
        for k in CONVERGENCE_K:
            for ef in (True, False) if k < 1.0 else (False,):
                label = "100% (dense)" if k >= 1.0 else f"{k:.1%} {'EF' if ef else 'no EF'}"
                out.append(dict(task=task, k=k, ef=ef, label=label, epochs=args.epochs))
        if args.gap_epochs:
            for k in EXTRA_GAP_K:
                out.append(
                    dict(task=task, k=k, ef=True, label=f"{k:.1%} EF", epochs=args.gap_epochs)
                )
        if args.dgc and task == "mlp":
            out.append(
                dict(
                    task=task,
                    k=1.0,
                    ef=False,
                    label="100% SGD momentum 0.9",
                    epochs=args.epochs,
                    inner_momentum=0.9,
                    group="dgc",
                )
            )
            out.append(
                dict(
                    task=task,
                    k=0.001,
                    ef=True,
                    label="0.1% EF + DGC",
                    epochs=args.epochs,
                    group="dgc",
                    warmup=True,
                    options=dict(momentum_correction=0.9, local_clipnorm=5.0),
                )
            )
        for rank in POWERSGD_RANKS[:1] if args.quick else POWERSGD_RANKS:
            out.append(
                dict(
                    task=task,
                    k=None,
                    rank=rank,
                    ef=True,
                    label=f"PowerSGD rank {rank}",
                    epochs=args.epochs,
                    group="powersgd",
                    scope="layer",
                )
            )
    return out


def table(results: list[dict]) -> str:
    lines = [
        "| task | K | error feedback | train loss, epoch 5 | final train loss | test accuracy |"
        " bytes/step | compression | bytes to 90% test acc | gap: compressed vector |"
        " gap: fresh gradient | worst case sqrt(1-K/n) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ratio = r["dense_bytes_per_step"] / r["bytes_per_step"][-1]
        low_rank = r["k"] is None  # PowerSGD: no fresh-gradient gap measured, no worst case
        label = r["label"]
        if not (low_rank or "DGC" in label or "momentum" in label):
            label = "100%" if r["k"] >= 1.0 else f"{r['k']:.1%}"
        fresh, worst = (
            ("–", "–") if low_rank else (f"{r['grad_gap_mean']:.3f}", f"{r['norm_gap_bound']:.4f}")
        )
        lines.append(
            f"| {r['task']} | {label} | {'yes' if r['ef'] else 'no'} "
            f"| {r['loss'][min(4, len(r['loss']) - 1)]:.4f} | {r['loss'][-1]:.4f} "
            f"| {r['val_accuracy'][-1]:.4f} | {r['bytes_per_step'][-1]:,.0f} | {ratio:.1f}x "
            f"| {_bytes_to(r, 0.9)} | {r['norm_gap_mean']:.3f} | {fresh} | {worst} |"
        )
    return "\n".join(lines)


def _bytes_to(r: dict, accuracy: float) -> str:
    """Cumulative bytes per replica at the first epoch end with this test accuracy."""
    for acc, sent in zip(r["val_accuracy"], r["cumulative_bytes"], strict=True):
        if acc >= accuracy - 1e-6:  # accuracies arrive as float32: 324/360 reads 0.89999998
            return f"{sent:,.0f}"
    return "not reached"


def plot_gap(results, path):
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in results})
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 3.8), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        rs = [r for r in results if r["task"] == task and "group" not in r and r["k"] < 1.0]
        n = rs[0]["n"]
        grid = np.logspace(math.log10(min(r["k"] for r in rs)) - 0.2, 0, 100)
        ax.plot(grid * 100, np.sqrt(1 - np.minimum(grid, 1.0)), "k--", label="sqrt(1 - K/n)")
        series = (
            ("norm_gap", "o", "accumulator: ||acc - TopK(acc)|| / ||acc||"),
            ("grad_gap", "s", "fresh gradient: ||G - TopK(G)|| / ||G||"),
        )
        for key, marker, name in series:
            pts = sorted(
                (r["k"], r[f"{key}_mean"], r[f"{key}_min"], r[f"{key}_max"]) for r in rs if r["ef"]
            )
            if not pts:
                continue
            ks, mean, lo, hi = (np.array(v) for v in zip(*pts, strict=True))
            ax.errorbar(
                ks * 100, mean, yerr=[mean - lo, hi - mean], marker=marker, capsize=3, label=name
            )
        ax.set_xscale("log")
        ax.set_ylim(0, 1.05)
        ax.set(xlabel="K (% of n)", ylabel="norm gap", title=f"{task} (n = {n:,})")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
    fig.suptitle("TopK norm gap during training with error feedback, against the worst case")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_convergence(results, path, key="loss", bytes_axis=False):
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in results})
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 3.8), squeeze=False)
    colors = {0.001: "C0", 0.01: "C1", 0.1: "C2", 1.0: "k"}
    rank_colors = dict(zip(POWERSGD_RANKS, ("C4", "C5", "C6"), strict=True))
    for ax, task in zip(axes[0], tasks, strict=True):
        for r in results:
            if r["task"] != task or (r["k"] not in CONVERGENCE_K and "group" not in r):
                continue
            if r["epochs"] != max(x["epochs"] for x in results):
                continue
            low_rank = r.get("group") == "powersgd"
            if low_rank and not bytes_axis:  # PowerSGD only in accuracy against bytes
                continue
            dgc = "group" in r and not low_rank
            if low_rank:
                color, style = rank_colors[r["rank"]], "--"
            else:
                color = "C3" if dgc and r["k"] < 1 else ("C7" if dgc else colors[r["k"]])
                style = "-" if r["ef"] or r["k"] >= 1.0 else ":"
            if dgc:
                style = "-."
            xs = np.array(r["cumulative_bytes"]) if bytes_axis else np.arange(1, r["epochs"] + 1)
            ax.plot(xs, r[key], style, color=color, label=r["label"], lw=1.5)
        if bytes_axis:
            ax.set_xscale("log")
            ax.set(xlabel="cumulative bytes sent per replica", ylabel="test accuracy")
        else:
            ax.set_yscale("log")
            ax.set(xlabel="epoch", ylabel="training loss")
        ax.set_title(task)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(
        "Accuracy against bytes sent" if bytes_axis else "Convergence against K (dotted: no EF)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import matplotlib

    matplotlib.use("Agg")
    import tensorflow as tf

    from tf_sparsify.keras import plot_diagnostics

    cpu = tf.config.list_physical_devices("CPU")[0]
    if args.replicas > 1:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * args.replicas
        )
        strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(args.replicas)])
    else:
        strategy = tf.distribute.get_strategy()
    data = load_digits_split(args.seed)
    os.makedirs(args.out, exist_ok=True)
    results = []
    start = time.perf_counter()
    for cfg in configs(args):
        r = run(cfg, data, args, strategy)
        if "group" in cfg:
            r["group"] = cfg["group"]
        results.append(r)
        print(
            f"{r['task']:>6} {r['label']:<24} loss {r['loss'][-1]:.4f} "
            f"acc {r['val_accuracy'][-1]:.4f} "
            f"gap {r['norm_gap_mean']:.3f}/{r['grad_gap_mean']:.3f} "
            f"(worst {r['norm_gap_bound']:.3f}) {r['wall_s']:.1f}s",
            flush=True,
        )
        if r["task"] == "mlp" and r["k"] == 0.01 and r["ef"]:
            plot_diagnostics(
                r["records"],
                os.path.join(args.out, "diagnostics_mlp_topk1.png"),
                title="MLP on digits, TopK 1% with error feedback",
            )
    text = table(results)
    header = (
        f"{args.replicas} replica(s), global batch {args.batch_size}, SGD lr {args.lr}, "
        f"{args.epochs} epochs (extra-K runs: {args.gap_epochs}), TopK over the whole gradient, "
        "PowerSGD per layer; "
        f"gaps: mean over the second half of training, measured every {args.every} steps"
    )
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(header + "\n\n" + text + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump([{k: v for k, v in r.items() if k != "records"} for r in results], f, indent=1)
    plot_gap(results, os.path.join(args.out, "norm_gap_vs_k.png"))
    plot_convergence(results, os.path.join(args.out, "convergence.png"))
    plot_convergence(results, os.path.join(args.out, "accuracy_vs_bytes.png"), "val_accuracy", True)
    print("\n" + header + "\n\n" + text)
    print(f"\nwrote {args.out}/ in {time.perf_counter() - start:.0f}s")
    return results


if __name__ == "__main__":
    main()
