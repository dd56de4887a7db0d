"""Progress: every stage of autoplan's work counted as each of its items ends, with the time left,
on a terminal and in a log; nothing where it is off."""

import re

import pytest

import shrinkwrap as sw
from shrinkwrap.measuring import progress as progress_module
from shrinkwrap.measuring.progress import Stage, seconds_text

from autoplan_helpers import BATCH, FAST, mlp

pytestmark = pytest.mark.usefixtures("one_thread")


class Clock:
    """A clock that moves only when a test moves it (``now``)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_stage_counts_each_item_as_it_ends_and_estimates_what_is_left(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(progress_module, "clock", clock)
    told = []
    stage = Stage(lambda i, n, text: told.append((i, n, text)), "candidates", 4)
    assert told == [(0, 4, "candidates")]
    clock.now = 0.2
    stage.done("cached")  # too soon to say: the first rows may come from the cache
    assert told[-1] == (1, 4, "candidates: cached")
    clock.now = 10.0
    stage.done("swish()")  # 10 s for two items: 10 s for the two left
    assert told[-1] == (2, 4, "candidates, about 10 s left: swish()")
    clock.now = 130.0
    stage.say("timing each module's forward")  # a step of a long item: the count stays
    assert told[-1] == (2, 4, "candidates, about 2 min 10 s left: timing each module's forward")
    stage.recount(3)  # one candidate left unmeasured
    clock.now = 200.0
    stage.done("bn_act()")
    assert told[-1] == (3, 3, "candidates, 3 min 20 s in all: bn_act()")
    stage.end()  # all of them ran: nothing more to say
    assert len(told) == 5
    short = Stage(lambda i, n, text: told.append((i, n, text)), "verifying", 4)
    short.done("a plan")
    short.end()  # a search that ended after one round of four: said as all of them
    assert told[-1][:2] == (1, 1) and told[-1][2].endswith("in all: done")
    Stage(None, "quiet", 3).done("x")  # no progress function: nothing to call
    assert [seconds_text(s) for s in (0.4, 59, 61, 3600 * 2 + 65)] == ["0 s", "59 s", "1 min 1 s", "2 h 1 min"]


def _stages(told):
    """The calls split into stages: each starts at 0 with its label alone (a step of its first
    item, at 0 too, says what)."""
    out = []
    for call in told:
        if call[0] == 0 and ": " not in call[2]:
            out.append([])
        out[-1].append(call)
    return out


def test_autoplan_ticks_every_stage_as_each_row_ends_with_the_time_left(monkeypatch):
    # Each row measured takes 3 s of a fake clock; a tick comes after its row, not at the stage's end.
    from shrinkwrap.autoplan import rows as rows_module

    clock = Clock()
    monkeypatch.setattr(progress_module, "clock", clock)
    events = []
    real = rows_module.measure_plans

    def measured(make, plans, *args, **kw):
        out = real(make, plans, *args, **kw)
        clock.now += 3.0
        events.extend(("row", str(p)) for p in plans)
        return out

    monkeypatch.setattr(rows_module, "measure_plans", measured)
    sw.autoplan(mlp, BATCH, budget=0.45, max_slowdown=3.0,
                progress=lambda i, n, text: events.append((i, n, text, clock.now)), **FAST)
    told = [e for e in events if e[0] != "row"]
    assert told[-1][:3] == (1, 1, "done")
    stages = _stages(told[:-1])
    labels = [s[0][2] for s in stages]
    assert labels[:2] == ["baseline", "whole-model steps, each alone"], labels
    assert labels[2].startswith("candidates on top of") and labels[3].startswith("verifying, "), labels
    for stage in stages:
        # The count advances once an item, one by one, to the stage's count; the last says the time in all.
        # Between advances, only the rounds of a timing in turns are told, and a stage that ends early (as
        # verifying does) says once more that it is over.
        counts = [i for i, *_ in stage]
        assert list(dict.fromkeys(counts)) == list(range(stage[-1][1] + 1)) and counts == sorted(counts), stage
        again = [t for a, t in zip(stage, stage[1:]) if t[0] == a[0]]
        assert all("timed in turns, round" in t[2] for t in again[:-1]), stage
        assert stage[-1][0] == stage[-1][1], stage
        assert stage[-1][2].startswith(stage[0][2] + ", ") and " in all" in stage[-1][2], stage
        # The time left, once the stage has run a second (a row from the cache takes none), until it ends.
        began = stage[0][3]
        for i, n, text, now in stage[1:-1]:
            if i:
                assert bool(re.search(r", about \d+ s left", text)) == (now - began >= progress_module.SETTLED), stage
    # Each candidate's tick comes as its row ends: one row measured before each, none after the last.
    assert sum(1 for t in stages[2] if "forward timed" not in t[2]) > 3
    candidates = stages[2]
    at = [events.index(t) for t in candidates]
    for (before, after), tick in zip(zip(at, at[1:]), candidates[1:]):
        rows = [e for e in events[before:after] if e[0] == "row"]
        if tick[2].endswith("the base"):  # the base alone is a whole-model step's row, from the cache
            assert len(rows) <= 1, (tick, rows)
        else:
            assert len(rows) == (0 if "forward timed" in tick[2] else 1), (tick, rows)
    assert not any(e[0] == "row" for e in events[at[-1]:events.index(stages[3][0])])
    # A plan verified is timed in turns with the baseline: each round told as it ends.
    rounds = [t[2] for t in stages[3] if "timed in turns" in t[2]]
    assert rounds and "round 1 of 5 to 15: " in rounds[0] and "round 5 of 5 to 15: " in rounds[4], rounds


def test_piped_progress_is_a_line_per_item_and_none_with_progress_false(capsys):
    told = []
    sw.autoplan(mlp, BATCH, budget=0.45, progress=lambda i, n, text: told.append((i, n, text)), **FAST)
    sw.autoplan(mlp, BATCH, budget=0.45, progress=True, **FAST)
    lines = capsys.readouterr().err.splitlines()  # stderr is no terminal here: a log
    assert len(lines) == len(told) and all(re.fullmatch(r"shrinkwrap: \d+/\d+ .+", line) for line in lines)
    on_top = [line for line in lines if " candidates on top of " in line]
    n = int(re.match(r"shrinkwrap: 0/(\d+)", on_top[0]).group(1))
    assert n > 3 and len(on_top) == n + 1  # the stage's start, and a line as each item ended
    sw.autoplan(mlp, BATCH, budget=0.45, progress=False, **FAST)
    sw.plan_report("checkpoint('1')", mlp, BATCH, progress=False, **FAST)
    assert capsys.readouterr().err == ""
