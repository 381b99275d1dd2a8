"""StartupReport: what getting every variant ready took, for the log, tr-bench and tests."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StartupReport:
    seconds: float = 0.0  # get_ready, whole
    # its own steps besides the warm-ups and the graphs: starting the parallel compiles,
    # recording the convolutions on the meta device
    phases: dict[str, float] = field(default_factory=dict)
    cudnn: object | None = None  # cudnn.PrimeReport: cuDNN's search before the first step
    autotune_flush: object | None = None  # autotune_flush.FlushReport: the warm-up's autotuning
    children: dict | None = None  # children.Precompiler.summary(): each parallel compile, by variant
    launcher_ready_s: float | None = None  # seconds from the launcher's start until it could fork
    launcher_error: str = ""  # why it could not (its children then started as fresh processes)
    own: str | None = None  # the variant this process compiled itself beside the children
    loaded_s: dict[str, float] = field(default_factory=dict)  # per variant: loading its whole compile
    from_store: list[str] = field(default_factory=list)  # of those, kept by an earlier run
    preloaded: list[str] = field(default_factory=list)  # of those, loaded during cuDNN's search
    kept: list[str] = field(default_factory=list)  # the variants this run kept for later runs
    store_write_s: float = 0.0  # writing the compiles made here into the store
    whole_compile_s: dict[str, float] = field(default_factory=dict)  # per variant compiled whole here
    warmup_seconds: dict[str, float] = field(default_factory=dict)  # per variant: compile (or wait) and warm-up
    warmup_work: dict[str, dict] = field(default_factory=dict)  # per variant: graphs compiled / loaded here
    warmup_phases: dict[str, dict] = field(default_factory=dict)  # per variant: compiler timers
    graph_seconds: float = 0.0  # capturing the graphs
    capture_seconds: float = 0.0  # the warm-ups and the capture
    peak_after_warmup: int = 0  # the process's peak allocated bytes once the warm-up was done
    graphs: int = 0  # CUDA graphs captured

    def to_json(self) -> dict:
        """Plain JSON values (the nested reports as dicts)."""
        out = {k: v for k, v in self.__dict__.items() if k not in ("cudnn", "autotune_flush")}
        c = self.cudnn
        out["cudnn"] = None if c is None else {
            "convolutions": c.calls, "seconds": c.seconds, "in_first_compile": c.in_first_compile,
            "ahead_seconds": c.ahead_seconds, "waited": c.waited, "ahead_error": c.ahead_error}
        f = self.autotune_flush
        out["autotune_flush"] = None if f is None else {
            "benchmarks": f.benchmarks, "cut": f.cut, "full_bytes": f.full_bytes,
            "smallest_bytes": f.smallest_bytes, "supported": f.supported}
        return out
