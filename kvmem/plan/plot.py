"""Each rank's memory as a stacked bar (weights, activations, graphs, overhead, KV, free).

Needs matplotlib (the ``plot`` extra); imported only when a plot is asked for.
"""

from __future__ import annotations

from pathlib import Path

from kvmem.errors import ConfigError
from kvmem.plan.types import Plan
from kvmem.units import GiB

PARTS = (
    ("weights", "weights_bytes", "#4c72b0"),
    ("activations", "activation_bytes", "#dd8452"),
    ("CUDA graphs", "cuda_graph_bytes", "#937860"),
    ("overhead", "non_torch_bytes", "#8c8c8c"),
    ("KV cache", "kv_budget_bytes", "#55a868"),
)


def rank_segments(plan: Plan) -> list[dict[str, float]]:
    """GiB per part for each rank; ``free`` is the device memory nothing uses."""
    rows = []
    for r in plan.ranks:
        row = {label: getattr(r, attr) / GiB for label, attr, _ in PARTS}
        used = sum(row.values())
        row["free"] = max(0.0, r.memory_bytes / GiB - used) if r.memory_bytes else 0.0
        rows.append(row)
    return rows


def save_plot(plan: Plan, path: str | Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'kvmem[plot]'") from None
    path = Path(path)
    rows = rank_segments(plan)
    labels = [f"r{r.rank}\npp{r.pp_stage}/tp{r.tp_rank}" for r in plan.ranks]
    fig, ax = plt.subplots(figsize=(max(5.0, 0.7 * len(rows) + 3.5), 4.5))
    bottom = [0.0] * len(rows)
    for label, _, color in (*PARTS, ("free", None, "#e5e5e5")):
        heights = [row[label] for row in rows]
        ax.bar(labels, heights, bottom=bottom, label=label, color=color)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    e = plan.engine
    ax.set_ylabel("GiB")
    ax.set_title(f"{plan.model}\n{e.tokens:,} tokens, {e.max_concurrency:.2f}x at "
                 f"{e.max_model_len:,} tokens ({e.policy} KV budget)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except (OSError, ValueError) as err:  # unwritable path, unknown image format
        raise ConfigError(f"{path}: cannot write plot ({err})") from None
    finally:
        plt.close(fig)
    return path
