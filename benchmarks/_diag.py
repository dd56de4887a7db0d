import copy, sys, time, functools
from pathlib import Path
sys.path.insert(0, "benchmarks"); sys.path.insert(0, "src")
import torch
import shrinkwrap as sw
from run import MODELS, _load, build
from shrinkwrap.compare import _Copies, _row, _copy_onto
from shrinkwrap.measure.step import Options

def sync(): torch.cuda.synchronize()
for name in sys.argv[1:]:
    _, batch = _load(name, MODELS[name][1])
    m = build(name).cpu()
    dev = torch.device("cuda")
    for how, f in (("deepcopy+to", lambda: copy.deepcopy(m).to(dev)), ("copy_onto", lambda: _copy_onto(m, dev))):
        ts = []
        for _ in range(3):
            t = time.perf_counter(); x = f(); sync(); ts.append(time.perf_counter() - t); del x
        print(f"{name} {how}: " + " ".join(f"{v:.3f}" for v in ts))
    opts = Options(iterations=3, warmup=2, device="cuda", module_log=False)
    plans = ["", "autocast(torch.bfloat16)", "channels_last(), autocast(torch.bfloat16)", "bn_act(), autocast(torch.bfloat16)"]
    for text in plans * 2:
        t = time.perf_counter()
        prof, _, _ = _row(_Copies(m), sw.Plan.parse(text) if text else sw.Plan(), batch, opts, None)
        print(f"{name} row {text or 'baseline'}: wall {time.perf_counter()-t:.2f} s first {prof.first_ms:.0f} ms step {prof.step_ms:.0f} ms")
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        _row(_Copies(m), sw.Plan(), batch, opts, None)
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=50))
