"""Fresh processes for rows: started ahead, plans compiled ahead side by side and measured in turns, and the settings
and caches they share with this process."""

import multiprocessing
import os
import re
import subprocess
import sys
import time

import pytest
import torch

import shrinkwrap as sw

from measure_helpers import mlp


pytestmark = pytest.mark.usefixtures("one_thread")


def test_fresh_processes_start_the_next_rows_process_ahead_and_stop_it_when_closed():
    from shrinkwrap.compare import measure_plans
    from shrinkwrap.processes import FreshProcesses
    from shrinkwrap.measuring.profile import Options

    before = {c.pid for c in multiprocessing.active_children()}
    with FreshProcesses(mlp) as fresh:
        report = measure_plans(mlp, [sw.Plan(), sw.Plan([sw.checkpoint("0")])], torch.randn(16, 32),
                               Options(iterations=1, warmup=1, device="cpu"), isolate=True, processes=fresh)
        fresh.start_next()
        (waiting,) = fresh._waiting
        assert len(waiting._processes) == 1  # started ahead, unused
        process = next(iter(waiting._processes.values()))
    assert not fresh._waiting
    process.join(timeout=30)
    assert not process.is_alive()
    # Processes that measured a row were not waited for after it, and are gone once closed.
    assert not [c for c in multiprocessing.active_children() if c.pid not in before]
    assert report.isolation == "in subprocesses" and [r.status for r in report.rows] == ["ok", "ok"]
    assert report.rows[1].matched == ("0",)  # what the plan matched came back from its process


def test_fresh_processes_ahead_start_the_next_rows_process_as_each_row_starts():
    from shrinkwrap.processes import fresh as processes
    from shrinkwrap.processes import FreshProcesses

    for ahead in (False, True):
        with FreshProcesses(mlp, ahead=ahead) as fresh:
            pids = [fresh.run(os.getpid) for _ in range(2)]
            # Ahead, two wait: started as the rows started (the second row found its own ready).
            assert len(fresh._waiting) == (processes.AHEAD if ahead else 0)
        assert len(set(pids)) == 2 and os.getpid() not in pids
    # Stopped at once where asked (before the GPU's free memory is read), and started again by a row.
    with FreshProcesses(mlp, ahead=True) as fresh:
        fresh.start_next()
        assert len(fresh._waiting) == processes.AHEAD
        started = [p for pool in fresh._waiting for p in (pool._processes or {}).values()]
        fresh.stop_next()
        assert not fresh._waiting and not any(p.is_alive() for p in started)
        fresh.run(os.getpid)
        assert len(fresh._waiting) == processes.AHEAD
    assert not fresh._waiting  # closed: none left waiting


def test_a_progress_bar_is_redrawn_in_place_on_a_terminal_and_a_line_a_row_in_a_log(capsys, monkeypatch):
    sw.plan_report(sw.Plan([sw.checkpoint("0")]), mlp, torch.randn(16, 32), iterations=1, warmup=1, device="cpu",
                   progress=True)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "shrinkwrap: 0/2 rows" and len(lines) == 3, lines  # a line as each row ends
    assert re.fullmatch(r"shrinkwrap: 1/2 rows(, about .+ left)?: baseline", lines[1]), lines
    assert re.fullmatch(r"shrinkwrap: 2/2 rows, \d+ s in all: checkpoint\('0'\)", lines[2]), lines
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    bar = sw.ProgressBar()
    bar(1, 4, "baseline")
    bar(4, 4, "done")
    drawn = capsys.readouterr().err
    # 80 columns where the terminal's width cannot be read; a line one shorter, so that it never wraps
    assert drawn == ("\r" + "measuring [#####...............] 1/4 baseline".ljust(79)
                     + "\r" + "measuring [####################] 4/4 done".ljust(79) + "\n")  # a new line once done
    bar(2, 4, "x" * 200)
    assert capsys.readouterr().err == "\r" + ("measuring [##########..........] 2/4 " + "x" * 200)[:79]
    sw.ProgressBar(quiet=True)(1, 4, "baseline")
    assert capsys.readouterr().err == ""


class _Recording:
    """A loss that appends its process id, float32 matmul precision and the time to a file each time it
    runs (picklable: a spawned process gets it)."""

    def __init__(self, path) -> None:
        self.path = path

    def __call__(self, out):
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()} {torch.get_float32_matmul_precision()} {time.time()}\n")
        return out.float().mean()


def test_plans_compiled_ahead_run_their_first_iterations_in_processes_side_by_side(tmp_path):
    from shrinkwrap.processes import compile_ahead
    from shrinkwrap.measuring.profile import Options

    log = tmp_path / "steps"
    options = Options(loss_fn=_Recording(log), iterations=1, warmup=1, device="cpu")
    plans = [sw.Plan.parse("compile(backend='aot_eager')"), sw.Plan.parse("checkpoint('0'), compile(backend='aot_eager')"),
             sw.Plan.parse("compile(backend='no_such_backend')")]
    torch.set_float32_matmul_precision("high")  # a setting the compiler's caches key on: the processes take it
    try:
        at_once, errors = compile_ahead(mlp, plans, torch.randn(16, 32), options)
    finally:
        torch.set_float32_matmul_precision("highest")
    assert at_once == 3 and errors[:2] == [None, None] and "no_such_backend" in errors[2]
    lines = [line.split() for line in log.read_text().splitlines()]
    pids = [pid for pid, *_ in lines]
    # The warm-up and one more iteration, each plan that ran, in a process of its own.
    assert len(pids) == 4 and len(set(pids)) == 2 and str(os.getpid()) not in pids
    assert {precision for _, precision, _ in lines} == {"high"}
    # One plan alone, or one that cannot be sent to a process: nothing runs ahead (this process compiles it).
    log.unlink()
    assert compile_ahead(mlp, plans[:1], torch.randn(16, 32), options) == (0, [])
    assert compile_ahead(lambda: mlp(), plans, torch.randn(16, 32), options) == (0, [])
    assert not log.exists()


def _measured(make, plan, batch, options):
    """What a process ahead does once all have compiled, here: the time its turn began and ended."""
    began = time.time()
    time.sleep(0.5)
    return os.getpid(), began, time.time(), str(plan)


class _DiesInTurn:
    """``then`` of compile_ahead whose first caller dies during its turn (holding the lock)."""

    def __init__(self, path) -> None:
        self.path = path

    def __call__(self, make, plan, batch, options):
        try:
            os.close(os.open(self.path, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return "measured"
        os._exit(3)


class _DiesSecond:
    """A factory whose second caller (a process of its own) dies."""

    def __init__(self, path) -> None:
        self.path = path

    def __call__(self):
        try:
            os.close(os.open(self.path, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            os._exit(3)
        return mlp()


def test_plans_compiled_ahead_are_then_measured_there_one_at_a_time_once_all_have_compiled(tmp_path):
    from shrinkwrap.processes import compile_ahead
    from shrinkwrap.measuring.profile import Options

    log = tmp_path / "steps"
    options = Options(loss_fn=_Recording(log), iterations=1, warmup=1, device="cpu")
    plans = [sw.Plan.parse("compile(backend='aot_eager')"), sw.Plan.parse("checkpoint('0'), compile(backend='aot_eager')"),
             sw.Plan.parse("compile(backend='no_such_backend')")]
    seen: list[tuple[float, list[float]]] = []
    started = time.time()
    arrived = []
    at_once, out = compile_ahead(mlp, plans, torch.randn(16, 32), options, then=_measured,
                                 compiled=lambda seconds, cached: seen.append((time.time(), seconds)),
                                 finished=lambda i: arrived.append((i, time.time())))
    assert at_once == 3 and [text for *_, text in out] == [str(p) for p in plans]  # the one that failed too
    # Told as each plan's entry arrives, after its turn ended there.
    assert sorted(i for i, _ in arrived) == [0, 1, 2] and all(t >= out[i][2] for i, t in arrived)
    steps = [(int(pid), float(t)) for pid, _, t in (line.split() for line in log.read_text().splitlines())]
    turns = sorted((began, ended) for _, began, ended, _ in out)
    # Each in the process that compiled it, after every plan's first iterations, and no two at once.
    assert {pid for pid, *_ in out} == {pid for pid, _ in steps} | {out[2][0]} and len({pid for pid, *_ in out}) == 3
    assert max(t for _, t in steps) < turns[0][0]
    assert all(ended <= began for (_, ended), (began, _) in zip(turns, turns[1:]))
    # Told once, after the last compiled, with the seconds each plan's first iterations took.
    ((told, seconds),) = seen
    assert max(t for _, t in steps) < told and len(seconds) == 3 and all(0 < s < told - started for s in seconds)
    # One that dies: the other's turn never comes, and it ends with its first iterations' result.
    at_once, out = compile_ahead(_DiesSecond(tmp_path / "ticket"), plans[:2], torch.randn(16, 32), options, then=_measured,
                                 compiled=lambda seconds, cached: seen.append((time.time(), seconds)))
    (died,) = [o for o in out if o is not None]
    assert len(seen) == 1  # never all compiled
    assert at_once == 2 and out.count(None) == 1 and "BrokenProcessPool" in died
    # One that dies in its turn, holding the lock: the other's turn never comes, and it ends too.
    started = time.time()
    at_once, out = compile_ahead(mlp, plans[:2], torch.randn(16, 32), options, then=_DiesInTurn(tmp_path / "turn"))
    (died,) = [o for o in out if o is not None]
    assert out.count(None) == 1 and "BrokenProcessPool" in died and time.time() - started < 120


def _keyed(make, plan, batch, options, keys):
    """``then`` with a second turn: when its first turn ended, and the plan's key."""
    return time.time(), keys[str(plan)]


def _second(make, plan, batch, options, ended, before):
    """``after``: the plan, when its first turn ended and its second began, what the earlier
    second turns left, and for the later ones, how many came before it."""
    began = time.time()
    time.sleep(0.2)
    return (str(plan), ended, began, before), float(len(before))


def test_the_second_turns_of_plans_compiled_ahead_go_least_key_first_each_told_what_the_earlier_left():
    import functools

    from shrinkwrap.processes import compile_ahead
    from shrinkwrap.measuring.profile import Options

    options = Options(iterations=1, warmup=1, device="cpu")
    plans = [sw.Plan.parse("compile(backend='aot_eager')"), sw.Plan.parse("checkpoint('0'), compile(backend='aot_eager')"),
             sw.Plan.parse("checkpoint('2'), compile(backend='aot_eager')")]
    keys = {str(plans[0]): float("nan"), str(plans[1]): 2.0, str(plans[2]): 1.0}  # no figure: last
    at_once, out = compile_ahead(mlp, plans, torch.randn(16, 32), options,
                                 then=functools.partial(_keyed, keys=keys), after=_second)
    assert at_once == 3 and [text for text, *_ in out] == [str(p) for p in plans]
    turns = sorted(out, key=lambda o: o[2])
    assert [text for text, *_ in turns] == [str(plans[2]), str(plans[1]), str(plans[0])]
    assert [before for *_, before in turns] == [[], [0.0], [0.0, 1.0]]
    # Every second turn after every first turn, and no two at once.
    assert max(ended for _, ended, _, _ in out) < turns[0][2]
    assert all(b - a >= 0.2 for a, b in zip([t[2] for t in turns], [t[2] for t in turns[1:]]))


def _keyed_raising(make, plan, batch, options, keys, bad):
    """``then`` that raises for the plan ``bad``."""
    if str(plan) == bad:
        raise RuntimeError("no row (a stand-in)")
    return _keyed(make, plan, batch, options, keys)


def _second_raising(make, plan, batch, options, ended, before, bad):
    """``after`` that raises for the plan ``bad``."""
    if str(plan) == bad:
        raise RuntimeError("CUDA out of memory (a stand-in)")
    return _second(make, plan, batch, options, ended, before)


def test_a_turn_that_raises_is_its_plans_entry_and_the_others_turns_go_on():
    import functools

    from shrinkwrap.processes import compile_ahead
    from shrinkwrap.measuring.profile import Options

    options = Options(iterations=1, warmup=1, device="cpu")
    plans = [sw.Plan.parse("compile(backend='aot_eager')"), sw.Plan.parse("checkpoint('0'), compile(backend='aot_eager')"),
             sw.Plan.parse("checkpoint('2'), compile(backend='aot_eager')")]
    keys = {str(plans[0]): 3.0, str(plans[1]): 1.0, str(plans[2]): 2.0}
    at_once, out = compile_ahead(mlp, plans, torch.randn(16, 32), options, then=functools.partial(_keyed, keys=keys),
                                 after=functools.partial(_second_raising, bad=str(plans[2])))
    assert at_once == 3 and out[2] == "RuntimeError: CUDA out of memory (a stand-in)"
    # The one after it still had its turn, told what the one before it left and that the failed one left nothing.
    assert out[1][3] == [] and out[0][3] == [0.0, float("inf")]
    # One that raises in its first turn: its second passes, and the others' go on.
    at_once, out = compile_ahead(mlp, plans, torch.randn(16, 32), options,
                                 then=functools.partial(_keyed_raising, keys=keys, bad=str(plans[1])), after=_second)
    assert out[1].startswith("RuntimeError") and out[2][3] == [] and out[0][3] == [0.0]


def test_plans_compiled_ahead_where_not_all_run_at_once_go_in_waves_each_taking_its_turns(monkeypatch):
    import functools

    from shrinkwrap.processes import ahead as processes
    from shrinkwrap.measuring.profile import Options

    monkeypatch.setattr(processes, "_processes_fitting", lambda device, room: 2)  # the GPU's memory holds two
    options = Options(iterations=1, warmup=1, device="cpu")
    plans = [sw.Plan.parse("compile(backend='aot_eager')"), sw.Plan.parse("checkpoint('0'), compile(backend='aot_eager')"),
             sw.Plan.parse("checkpoint('2'), compile(backend='aot_eager')")]
    keys = {str(plans[0]): 2.0, str(plans[1]): 1.0, str(plans[2]): 0.5}
    told = []
    at_once, out = processes.compile_ahead(mlp, plans, torch.randn(16, 32), options,
                                           then=functools.partial(_keyed, keys=keys), after=_second,
                                           compiled=lambda seconds, cached: told.append((time.time(), seconds)))
    assert at_once == 2 and [text for text, *_ in out] == [str(p) for p in plans]
    first, second, last = out[1], out[0], out[2]  # the first wave by key, then the second wave
    assert [before for *_, before in (first, second, last)] == [[], [0.0], [0.0, 1.0]]
    assert second[2] < last[1]  # the second wave's turns after the first wave's
    # Told once, when the last wave had compiled, with every plan's first iterations.
    ((when, seconds),) = told
    assert second[2] < when and len(seconds) == 3 and all(s > 0 for s in seconds)


def test_plans_compiled_ahead_say_how_many_graphs_came_from_the_on_disk_caches(tmp_path, monkeypatch):
    # Inductor on the CPU, the caches in a folder of the test's own: the first call compiles each
    # plan's graphs anew, a second call takes them all from the caches, and says so.
    from shrinkwrap.processes import compile_ahead
    from shrinkwrap.measuring.profile import Options

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # the processes' own
    plans = [sw.Plan.parse("compile()"), sw.Plan.parse("checkpoint('0'), compile()")]
    told = []
    for _ in range(2):
        compile_ahead(mlp, plans, torch.randn(16, 32), Options(iterations=1, warmup=1, device="cpu"), then=_measured,
                      compiled=lambda seconds, cached: told.append(cached))
    (hits, misses), again = told
    assert hits == 0 and misses >= 2 and again == (misses, 0)


def _meet_on_exit(folder: str, count: int) -> None:
    """A process's last act (a finalizer, as a compiler's worker pool shutting down): say it is
    exiting, then wait until ``count`` processes are, and say whether they all met."""
    mine = os.path.join(folder, str(os.getpid()))
    open(mine + ".exiting", "w").close()
    deadline = time.monotonic() + 60  # past compile_ahead's grace: a process left alone is terminated
    while time.monotonic() < deadline:
        if len([f for f in os.listdir(folder) if f.endswith(".exiting")]) == count:
            open(mine + ".met", "w").close()
            return
        time.sleep(0.05)


class _MeetOnExit:
    """``then`` of a process that, once told to exit, exits only beside the others."""

    def __init__(self, folder: str, count: int) -> None:
        self.folder, self.count = folder, count

    def __call__(self, make, plan, batch, options):
        import multiprocessing.util

        multiprocessing.util.Finalize(None, _meet_on_exit, args=(self.folder, self.count), exitpriority=0)
        return os.getpid()


def test_processes_ahead_whose_turns_end_together_exit_side_by_side(tmp_path):
    from shrinkwrap.processes import compile_ahead
    from shrinkwrap.measuring.profile import Options

    plans = [sw.Plan.parse("compile(backend='eager')"), sw.Plan.parse("checkpoint('0'), compile(backend='eager')"),
             sw.Plan.parse("checkpoint('2'), compile(backend='eager')")]
    at_once, out = compile_ahead(mlp, plans, torch.randn(16, 32), Options(iterations=1, warmup=1, device="cpu"),
                                 then=_MeetOnExit(str(tmp_path), len(plans)))
    # Told to exit one after another, the first would wait alone until it was terminated, and
    # only the last would see all three exiting.
    met = sorted(int(f.name.split(".")[0]) for f in tmp_path.glob("*.met"))
    assert at_once == 3
    assert met == sorted(out), "the processes exited one after another, not side by side"


def test_a_process_ahead_given_settings_equal_to_its_own_leaves_what_the_caches_key_on_as_it_was():
    """Setting float32 matmul precision to the "highest" it already was turns torch's cache key
    (``fp32_precision``) from "none" to "ieee": every graph a process ahead compiled then missed
    the caches of the process that sent it (H100, torch 2.11). Run in a fresh interpreter, whose
    settings no other test has touched; a setting that differs is still taken."""
    code = """if True:
        import torch, torch.nn as nn
        from shrinkwrap.processes.ahead import compile_settings, _first_steps
        from shrinkwrap.measuring.profile import Options
        from shrinkwrap.plan import Plan
        settings = compile_settings()
        before = torch.backends.cuda.matmul.fp32_precision
        assert _first_steps(lambda: nn.Linear(4, 2), Plan(), torch.randn(3, 4), Options(device="cpu", warmup=1), settings) is None
        print(before, torch.backends.cuda.matmul.fp32_precision, end=" ")
        settings["matmul"].update(legacy="high", fp32_precision="tf32", allow_bf16_reduced_precision_reduction=False)
        _first_steps(lambda: nn.Linear(4, 2), Plan(), torch.randn(3, 4), Options(device="cpu", warmup=1), settings)
        matmul = torch.backends.cuda.matmul
        print(torch.get_float32_matmul_precision(), matmul.fp32_precision, matmul.allow_bf16_reduced_precision_reduction)
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["none", "none", "high", "tf32", "False"]
    # A process that set the precision through torch's newer API (reading it the legacy way then
    # raises): it is sent, and taken, as that API's setting.
    code = """if True:
        import torch
        from shrinkwrap.processes.settings import compile_settings, _take_matmul_settings
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        print(compile_settings()["matmul"])
    """
    sent = eval(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert "legacy" not in sent and sent["fp32_precision"] == "tf32"
    code = f"""if True:
        import torch
        from shrinkwrap.processes.settings import _take_matmul_settings
        _take_matmul_settings({sent!r})
        print(torch.backends.cuda.matmul.fp32_precision)
    """
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split() == ["tf32"]


@pytest.mark.parametrize("first", ["torch", "multiprocessing"])
def test_a_main_script_that_imports_torch_compiles_here_what_its_processes_compiled_ahead(tmp_path, first):
    # The caches key on tensors' metadata pickled, which names torch's memory formats after a
    # module found in sys.modules, where the main script sits (as __mp_main__) at another place in
    # a spawned process than in its parent: without the fix the parent found none of its keys.
    # A script of its own, whose main module has torch (pytest's has not). Imported after torch,
    # multiprocessing puts __mp_main__ after torch's modules in the parent only: the keys differed
    # (0 of 2 hits without the fix). Imported first, it puts it first in both, and the fix must keep
    # the keys alike.
    script = tmp_path / "main.py"
    script.write_text(f"""if True:
        import {first}
        import torch, torch.nn as nn
        import shrinkwrap as sw
        from shrinkwrap.processes import compile_ahead
        from shrinkwrap.measuring.profile import Options
        from shrinkwrap.measuring.step import setup_iteration

        def make():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))

        if __name__ == "__main__":
            from torch._dynamo.utils import counters
            plans = [sw.Plan.parse("checkpoint('0'), compile()"), sw.Plan.parse("checkpoint('2'), compile()")]
            x = torch.randn(4, 8)
            assert compile_ahead(make, plans, x, Options(device="cpu", warmup=1, iterations=1)) == (2, [None, None])
            for plan in plans:  # the training step the measuring harness runs (on a CPU measure()'s
                # reading of saved bytes compiles other graphs)
                torch._dynamo.reset()  # each plan compiled as a fresh process would
                step, _ = setup_iteration(sw.apply(make(), plan), x, Options(device="cpu"), torch.device("cpu"))
                step()
            print(dict(counters["aot_autograd"]))
    """)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    counts = eval(out.stdout.strip().splitlines()[-1])
    assert counts.get("autograd_cache_hit") == 2 and not counts.get("autograd_cache_miss"), counts


@pytest.mark.cuda
def test_processes_ahead_count_what_this_process_keeps_cached_and_unused_as_free():
    from shrinkwrap.processes.ahead import PROCESS_MARGIN, _processes_fitting

    device = torch.device("cuda")
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info(device)[0]
    room = free // 4 - PROCESS_MARGIN  # four such rows fill what is free
    block = torch.empty(free * 3 // 4, dtype=torch.uint8, device=device)
    del block  # kept by the allocator, unused: as after a row measured here
    assert torch.cuda.mem_get_info(device)[0] < free // 3  # what the card reports free now
    assert _processes_fitting(device, room) >= 3 and torch.cuda.memory_reserved(device) < free // 4


@pytest.mark.cuda
def test_a_plan_compiled_ahead_compiles_here_from_the_on_disk_cache(tmp_path, monkeypatch):
    from torch._dynamo.utils import counters

    from shrinkwrap.processes import compile_ahead
    from shrinkwrap.measuring.profile import Options

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # cold for this test; the processes inherit it
    plans = [sw.Plan.parse("compile()"), sw.Plan.parse("autocast(torch.bfloat16), compile()")]
    options = Options(iterations=1, warmup=2, device="cuda")
    x = torch.randn(64, 32)
    free = torch.cuda.mem_get_info()[0]
    assert compile_ahead(mlp, plans, x, options, room=free) == (0, [])  # memory for one process only
    assert compile_ahead(mlp, plans, x, options, room=2**20) == (2, [None, None])
    torch._dynamo.reset()
    counters.clear()
    sw.measure(sw.apply(mlp(), plans[1]), x, device="cuda", warmup=2, iterations=1)
    # Forward and backward from the caches: AOTAutograd's where its key matches (inductor's is then
    # not asked), else inductor's; neither compiles anything anew.
    aot, fx = dict(counters["aot_autograd"]), dict(counters["inductor"])
    hits = max(aot.get("autograd_cache_hit", 0), fx.get("fxgraph_cache_hit", 0))
    assert hits >= 2 and not fx.get("fxgraph_cache_miss"), (aot, fx)


def test_a_process_started_ahead_imports_the_modules_of_the_models_classes_and_never_calls_the_factory(
        tmp_path, monkeypatch):
    import sys

    from shrinkwrap.processes.fresh import _ready

    (tmp_path / "shrinkwrap_test_models_xyz.py").write_text("LOADED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    built = []
    assert "shrinkwrap_test_models_xyz" not in sys.modules
    try:
        _ready(lambda: built.append(1), ["shrinkwrap_test_models_xyz", "no_such_module_xyz"])
        assert sys.modules["shrinkwrap_test_models_xyz"].LOADED  # imported; the missing one is passed over
    finally:
        sys.modules.pop("shrinkwrap_test_models_xyz", None)
    assert built == []  # a factory may cache what it builds, or act: only the row calls it
