"""tr-bench, then Dynamo/Inductor's own compile-phase timings of this (the main) process."""
import os, runpy, sys
sys.argv = ["tr-bench"] + sys.argv[1:]
try:
    runpy.run_module("tr_hydra.cli.bench", run_name="__main__")
except SystemExit:
    pass
import torch._dynamo.utils as u
out = os.environ.get("OUT", "/tmp")
with open(os.path.join(out, "compile_times.txt"), "w") as f:
    f.write(u.compile_times(repr="str", aggregate=True))
print(u.compile_times(repr="str", aggregate=True)[:6000])
