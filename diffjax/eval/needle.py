"""Protocol "needle": multi-needle retrieval accuracy (paper §3.4): Table 2 (N needles × R query cities) and Fig. 5
(answer depth × context length); the cells and their defaults: docs/design.md §6, "Protocol details"."""

from __future__ import annotations

import functools

import flax.linen as nn
import numpy as np

from diffjax.config import Config, ConfigError
from diffjax.data.sources import DataError
from diffjax.data.synthetic import DEPTHS, MAX_NEEDLES, RetrievalTask, retrieval_examples
from diffjax.data.tokenizer import TOKENIZERS, get_tokenizer
from diffjax.eval import Protocol, progress, register, table
from diffjax.eval.scoring import answer_hits, make_predict

FRACTIONS = (0.25, 0.5, 0.75, 1.0)  # default Fig. 5 lengths, as fractions of the trained seq_len


def does_not_fit(tokenizer, n_needles: int, n_query_cities: int, length: int) -> str | None:
    """None when N needles and R questions fit in `length` tokens, else why not."""
    try:
        RetrievalTask(tokenizer, length, n_needles, n_query_cities)
    except DataError as e:
        return str(e)
    return None


def needle_eval(cfg: Config, params, *, n: int = 32, needles: tuple[int, ...] = (1, 2, 4, 6),
                query_cities: tuple[int, ...] = (1, 2), heatmap_needles: int | None = None,
                heatmap_query_cities: int | None = None, lengths: tuple[int, ...] = (), allow_longer: bool = False,
                depths: tuple[float, ...] = DEPTHS, batch_size: int | None = None, seed: int | None = None) -> dict:
    """{"table2": {needles, query_cities, accuracy [N][R] (None: skipped or does not fit), by_depth},
    "heatmap": {n_needles, n_query_cities, lengths, accuracy [depth][length], mean [length]}, "missing": [...]}."""
    seq_len = cfg.data.seq_len
    heat_n = cfg.data.n_needles if heatmap_needles is None else heatmap_needles
    heat_r = cfg.data.n_query_cities if heatmap_query_cities is None else heatmap_query_cities
    batch_size = cfg.data.batch_size if batch_size is None else batch_size  # no more rows than a training batch
    if n <= 0 or batch_size <= 0:
        raise ConfigError(f"eval.n and eval.batch_size must be positive, got {n} and {batch_size}")
    if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
        raise ConfigError(f"eval.depths: need depths in [0, 1], got {depths}")
    for name, values in (("eval.needles", needles), ("eval.query_cities", query_cities),
                         ("eval.heatmap_needles", (heat_n,)), ("eval.heatmap_query_cities", (heat_r,))):
        if not values or any(not 1 <= v <= MAX_NEEDLES for v in values):
            raise ConfigError(f"{name}: need values in [1, {MAX_NEEDLES}] (one city per needle), got {values}")
    if heat_r > heat_n:
        raise ConfigError(f"eval.heatmap_query_cities ({heat_r}) exceeds eval.heatmap_needles ({heat_n})")
    too_long = [x for x in lengths if x > seq_len]
    if too_long and not allow_longer:
        raise ConfigError(f"eval.lengths {too_long} exceed the trained data.seq_len {seq_len}; the model never saw "
                          f"positions that far (set eval.allow_longer=true to evaluate length extrapolation)")
    if any(x < 2 for x in lengths):
        raise ConfigError(f"eval.lengths must be at least 2 tokens, got {lengths}")

    tokenizer = get_tokenizer(cfg.data.tokenizer)
    predict, params = make_predict(cfg, batch_size), nn.meta.unbox(params)
    missing: list[str] = []
    if lengths:
        heat_lengths = list(dict.fromkeys(int(x) for x in lengths))
    else:
        heat_lengths = []
        for x in dict.fromkeys(max(2, round(f * seq_len)) for f in FRACTIONS):
            if (why := does_not_fit(tokenizer, heat_n, heat_r, x)) is None:
                heat_lengths.append(x)
            else:
                missing.append(f"default length {x} left out: {why}")

    @functools.cache
    def cell(n_needles: int, n_query: int, length: int) -> list[float] | None:
        """Accuracy per depth (None: does not fit), computed once per (N, R, length)."""
        if (why := does_not_fit(tokenizer, n_needles, n_query, length)) is not None:
            missing.append(f"N={n_needles}, R={n_query}, length {length}: {why}")
            return None
        accs = []
        for depth in depths:
            batch = retrieval_examples(cfg.data, n, depth=depth, tokenizer=tokenizer, seed=seed,
                                       n_needles=n_needles, n_query_cities=n_query, seq_len=length)
            accs.append(float(np.mean(answer_hits(predict(params, batch), batch))))
        return accs

    combos = [(k, r, seq_len) for k in needles for r in query_cities if r <= k]
    for combo in progress(combos + [(heat_n, heat_r, x) for x in heat_lengths], "needle"):
        cell(*combo)

    table_depth = [[cell(k, r, seq_len) if r <= k else None for r in query_cities] for k in needles]
    table_acc = [[None if a is None else float(np.mean(a)) for a in accs] for accs in table_depth]
    heat = [cell(heat_n, heat_r, x) for x in heat_lengths]
    return {
        "seq_len": seq_len, "n": n, "depths": [float(d) for d in depths],
        "table2": {"needles": list(needles), "query_cities": list(query_cities), "accuracy": table_acc,
                   "by_depth": table_depth},
        "heatmap": {"n_needles": heat_n, "n_query_cities": heat_r, "lengths": heat_lengths,
                    "accuracy": [[None if a is None else a[i] for a in heat] for i in range(len(depths))],
                    "mean": [None if a is None else float(np.mean(a)) for a in heat]},
        "missing": missing,
    }


def applies(cfg: Config) -> bool:
    return cfg.data.source == "synthetic" and "retrieval" in cfg.data.tasks and cfg.data.tokenizer in TOKENIZERS


def _fmt(value, skipped: bool = False) -> str:
    return "—" if skipped else "n/f" if value is None else f"{value:.2f}"


def markdown(results: dict[str, dict]) -> str:
    first = next(iter(results.values()))
    t2 = first["table2"]
    rows = [[str(n_needles), *(_fmt(r["table2"]["accuracy"][i][j], q > n_needles) for r in results.values()
                               for j, q in enumerate(t2["query_cities"]))] for i, n_needles in enumerate(t2["needles"])]
    lines = [f"Multi-needle retrieval accuracy in {first['seq_len']}-token contexts, averaged over the answer needle "
             f"depths (paper §3.4, Table 2); N needles, R query cities, {first['n']} examples per depth.", "",
             table(["N", *(f"{label} R={r}" for label in results for r in t2["query_cities"])], rows), "",
             "—: R > N (skipped); n/f: the needles and questions do not fit in the length."]
    for label, r in results.items():
        h = r["heatmap"]
        lines += ["", f"{label}: accuracy by answer depth × context length, N={h['n_needles']}, "
                      f"R={h['n_query_cities']} (paper Fig. 5)", "",
                  "| depth | " + " | ".join(str(x) for x in h["lengths"]) + " |",
                  "|---" * (1 + len(h["lengths"])) + "|"]
        for depth, row in zip(r["depths"], h["accuracy"], strict=True):
            lines.append(f"| {depth:.0%} | " + " | ".join(_fmt(v) for v in row) + " |")
        lines.append("| **avg** | " + " | ".join(_fmt(v) for v in h["mean"]) + " |")
    shared = all(r["missing"] == first["missing"] for r in results.values())
    for label, r in ({"all runs": first} if shared else results).items():
        if r["missing"]:
            lines += ["", f"Missing ({label}): " + "; ".join(r["missing"])]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, dict], path) -> None:
    from diffjax.plotting import pyplot, save

    plt = pyplot()

    width = max(2, *(len(r["heatmap"]["lengths"]) for r in results.values()))
    fig, axes = plt.subplots(1, len(results), figsize=((1.0 + 1.3 * width) * len(results), 3.8), squeeze=False)
    cmap = plt.get_cmap("RdYlGn").with_extremes(bad="lightgrey")
    for ax, (label, r) in zip(axes[0], results.items(), strict=True):
        h = r["heatmap"]
        if not h["lengths"]:
            ax.text(0.5, 0.5, f"{label}: the task fits in no length", ha="center", va="center")
            ax.axis("off")
            continue
        grid = np.array([[np.nan if v is None else v for v in row] for row in [*h["accuracy"], h["mean"]]],
                        dtype=float).reshape(len(r["depths"]) + 1, len(h["lengths"]))
        image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0, vmax=1, aspect="auto")
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.03, label="exact retrieval accuracy")
        for (i, j), v in np.ndenumerate(grid):
            ax.text(j, i, "n/f" if np.isnan(v) else f"{v:.2f}", ha="center", va="center", fontsize=8)
        ax.axhline(len(r["depths"]) - 0.5, color="black", lw=1)
        ax.set_xticks(range(len(h["lengths"])), [str(x) for x in h["lengths"]])
        ax.set_yticks(range(len(r["depths"]) + 1), [f"{d:.0%}" for d in r["depths"]] + ["avg"])
        ax.set(xlabel="context length", ylabel="answer needle depth",
               title=f"{label}\nexact retrieval accuracy, N={h['n_needles']} needles, R={h['n_query_cities']} "
                     f"questions (n/f: does not fit)")
    save(fig, path)


register(Protocol("needle", needle_eval, applies, markdown=markdown, plot=plot))
