"""Summary table of a multirun sweep, printed when the sweep ends (a Hydra callback)."""
from __future__ import annotations

import json
from pathlib import Path

from hydra.experimental.callback import Callback


def sweep_rows(sweep_dir: Path) -> list[dict]:
    rows = []
    for job in sorted(Path(sweep_dir).iterdir(), key=lambda p: (len(p.name), p.name)):
        metrics, overrides = job / "metrics.json", job / ".hydra" / "overrides.yaml"
        if not metrics.is_file():
            continue
        import yaml
        m = json.loads(metrics.read_text())
        s = m.get("summary", {})
        rows.append({"job": job.name,
                     "overrides": " ".join(yaml.safe_load(overrides.read_text()) or []) if overrides.is_file() else "",
                     "best_val_top1": s.get("best_val_top1"), "final_val_loss": s.get("final_val_loss"),
                     "img_per_sec": s.get("img_per_sec"), "steps": s.get("steps")})
    return rows


def format_table(rows: list[dict]) -> str:
    if not rows:
        return "sweep: no finished runs"
    width = max(len(r["overrides"]) for r in rows)
    lines = [f"{'job':>4}  {'overrides':<{width}}  {'best val top1':>13}  {'val loss':>9}  {'img/s':>10}"]
    for r in rows:
        lines.append(f"{r['job']:>4}  {r['overrides']:<{width}}  {r['best_val_top1']:>13.2f}  "
                     f"{r['final_val_loss']:>9.4f}  {r['img_per_sec']:>10,.1f}")
    return "\n".join(lines)


class SweepSummary(Callback):
    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = sweep_rows(sweep_dir)
        table = format_table(rows)
        print(f"\nsweep summary ({sweep_dir}):\n{table}", flush=True)
        (sweep_dir / "summary.txt").write_text(table + "\n")
