"""autoplan's search over candidates: failing and overlapping steps, the regex of a plan's regions, the exact set
within the limits, and the candidates a stack offers."""

import pytest
import torch
import torch.nn as nn

import shrinkwrap as sw
from shrinkwrap.autoplan import candidates

from autoplan_helpers import BATCH, FAST, Naive, _effects_table, mlp


pytestmark = pytest.mark.usefixtures("one_thread")


class NoRecompute(nn.Module):
    """A block that cannot run again in backward (it would, checkpointed)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        if torch._C._current_graph_task_id() != -1:
            raise RuntimeError("cannot be recomputed")
        return torch.tanh(self.lin(x))


def test_a_failing_candidate_is_a_row_and_a_note_and_the_search_goes_on():
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.Sequential(NoRecompute(), NoRecompute(), NoRecompute()),
                             nn.Sequential(*[nn.Sequential(nn.Linear(32, 64), Naive(), nn.Linear(64, 32))
                                             for _ in range(3)]), nn.Linear(32, 4))

    plan, report = sw.autoplan(make, BATCH, budget=0.6, **FAST)
    failed = [r for r in report.rows if r.status == "failed"]
    assert failed and all("cannot be recomputed" in r.error for r in failed)
    assert any(n.startswith("left:") and "failed (RuntimeError: cannot be recomputed)" in n for n in report.notes)
    assert not any(s.pattern in (("1",), ("1.0",)) for s in plan if isinstance(s, sw.checkpoint))
    sw.apply(make(), plan)(BATCH).sum().backward()  # the answer runs


def test_a_model_whose_swish_follows_batchnorm_answers_an_unreachable_budget():
    def make():
        torch.manual_seed(0)
        block = lambda: nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), Naive())  # noqa: E731
        return nn.Sequential(nn.Conv2d(3, 4, 1), nn.Sequential(block(), block(), block()), nn.Flatten())

    plan, report = sw.autoplan(make, torch.randn(4, 3, 8, 8), budget="1B", **FAST)  # 1 byte: unreachable
    assert "no plan found within the limits" in " ".join(report.notes)
    model = sw.apply(make(), plan)
    model(torch.randn(4, 3, 8, 8)).sum().backward()


def test_a_step_whose_modules_an_earlier_step_took_does_nothing_with_a_note():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), Naive())
    sw.apply(model, [sw.bn_act(), sw.swish()])  # bn_act fuses the Swish that swish() would replace
    rec = sw.records(model)[-1]
    assert rec.step == sw.swish() and rec.matched == () and "nothing left to do" in rec.notes[0]
    with pytest.raises(sw.SelectionError):  # alone, on a model without Swish, it is still an error
        sw.apply(nn.Sequential(nn.Linear(2, 2)), [sw.swish()])
    sw.revert(model)
    assert isinstance(model[2], Naive)


def test_chosen_regions_read_as_one_regex_that_selects_exactly_them():
    def blocks12():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.Sequential(*[nn.Sequential(nn.Linear(32, 64), nn.Tanh(),
                                                                               nn.Linear(64, 32)) for _ in range(12)]))

    model = blocks12()
    chosen = [c for c in candidates(model, device="cpu", max_groups=12) if len(c.covers) == 1 and c.covers[0].startswith("1.")]
    from shrinkwrap.autoplan.choose import _plan

    for picked in (chosen, chosen[9:], chosen[2:3]):
        plan = _plan(picked, model)
        (step,) = plan.steps
        assert isinstance(step.pattern, str) and sw.Plan.parse(str(plan)) == plan
        assert sw.select(model, step.pattern) == [n for c in picked for n in c.covers]
    assert str(_plan(chosen, model)) == r"checkpoint(r'1\.\d+')"
    assert str(_plan(chosen[9:], model)) == r"checkpoint(r'1\.(?:9|1[01])')"


@pytest.mark.parametrize("names, expected", [
    (["layer1.0", "layer1.1", "layer2.0", "layer2.1", "layer4.0"], r"layer[12]\.\d+|layer4\.0"),
    ([f"layer3.{i}" for i in range(9, 18)], r"layer3\.(?:9|1[0-7])"),
    ([f"layer3.{i}" for i in range(10, 36)], r"layer3\.(?:[12]\d|3[0-5])"),
    (["layer1.0", "layer3.0"], r"layer[13]\.0"),
    (["conv1", "bn1", "relu", "maxpool"], "conv1|bn1|relu|maxpool"),
    (["layer1.1", "layer2.0"], r"layer1\.1|layer2\.0"),
])
def test_block_names_read_as_a_short_regex_that_selects_exactly_them(names, expected):
    from shrinkwrap.select import pattern_for

    def stage(n):
        return nn.Sequential(*[nn.Sequential(nn.Linear(2, 2)) for _ in range(n)])

    model = nn.Module()
    model.conv1, model.bn1, model.relu, model.maxpool = nn.Linear(2, 2), nn.Identity(), nn.ReLU(), nn.Identity()
    for i, n in enumerate((2, 2, 36, 2), 1):
        setattr(model, f"layer{i}", stage(n))
    text = pattern_for(model, names)
    assert text == expected and sorted(sw.select(model, text)) == sorted(names)


def test_the_search_finds_the_fastest_set_within_the_budget_where_greedy_orders_miss_it():
    from shrinkwrap.autoplan.choose import _search

    # The whole stage saves the most, and a greedy order by saving takes it and shuts out the groups;
    # two groups together fit the budget and are faster.
    table = _effects_table(("stage", ("s",), 7.0, 9.0), ("a", ("s.0",), 3.0, -2.0), ("b", ("s.1",), 2.3, -1.0),
                           ("c", ("s.2",), 1.0, 8.0), ("failed", ("t",), 0.0, 0.0))
    chosen = _search(table, 7.9, 100.0, target=4.2, max_t=None)
    assert sorted(str(e.candidate) for e in chosen) == ["checkpoint('a')", "checkpoint('b')"]
    # No set reaches an impossible budget: the smallest set within the time limit.
    chosen = _search(table, 7.9, 100.0, target=0.1, max_t=110.0)
    assert [str(e.candidate) for e in chosen] == ["checkpoint('stage')"]


def test_the_search_finds_the_smallest_set_within_the_time_limit_where_greedy_orders_miss_it():
    from shrinkwrap.autoplan.choose import _search

    # Saving per millisecond is equal: greedy by saving takes x (6 MiB) and y no longer fits; y + z save 10.
    table = _effects_table(("x", ("x",), 6.0, 6.0), ("y", ("y",), 5.0, 5.0), ("z", ("z",), 5.0, 5.0))
    chosen = _search(table, 20.0, 100.0, target=None, max_t=110.0)
    assert sorted(str(e.candidate) for e in chosen) == ["checkpoint('y')", "checkpoint('z')"]


def test_a_candidate_that_only_runs_faster_pays_for_a_checkpoint():
    from shrinkwrap.autoplan.choose import _search

    # "fast" saves nothing (it costs a little memory) but wins 4 ms: with it the big checkpoint fits
    # the time limit; without it only the small one does.
    table = _effects_table(("big", ("a",), 8.0, 12.0), ("small", ("b",), 2.0, 5.0), ("fast", (), -0.5, -4.0))
    chosen = _search(table, 20.0, 100.0, target=None, max_t=108.0)
    assert sorted(str(e.candidate) for e in chosen) == ["checkpoint('big')", "checkpoint('fast')"]
    # Without a time limit, and with a budget no set reaches: the smallest set, and of equals the faster.
    table = _effects_table(("ckpt", ("a",), 100.0, 5.0), ("fast", (), 0.0, -15.0))
    for target in (None, 1.0):
        chosen = _search(table, 200.0, 100.0, target=target, max_t=None)
        assert sorted(str(e.candidate) for e in chosen) == ["checkpoint('ckpt')", "checkpoint('fast')"]
    # A slower candidate that saves nothing is never taken.
    table = _effects_table(("big", ("a",), 8.0, 12.0), ("slow", ("c",), 0.0, 1.0))
    assert [str(e.candidate) for e in _search(table, 20.0, 100.0, target=None, max_t=120.0)] == ["checkpoint('big')"]


def test_the_demo_model_gets_a_plan_within_a_budget_of_three_tenths():
    from shrinkwrap.models import tiny_efficientnet

    batch = torch.randn(8, *tiny_efficientnet.input_shape, generator=torch.Generator().manual_seed(0))
    plan, report = sw.autoplan(tiny_efficientnet, batch, budget=0.3, **FAST)
    assert not any("no plan found" in n for n in report.notes), report.notes
    assert sw.saved_tensor_bytes(sw.apply(tiny_efficientnet(), plan), batch) <= 0.3 * report.value(report.rows[0])


def test_a_long_stack_of_blocks_also_offers_every_second_and_third_block():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(6)]))
    covers = [c.covers for c in candidates(model, device="cpu")]
    assert ("1.1", "1.3", "1.5") in covers and ("1.2", "1.5") in covers
    short = [c.covers for c in candidates(mlp(), device="cpu")]  # four blocks: groups only
    assert not any(len(c) > 1 for c in short)


@pytest.mark.parametrize("blocks, alone", [(6, True), (12, True), (14, False)])
def test_each_block_of_a_stack_of_up_to_twelve_is_a_candidate_alone(blocks, alone):
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh())
                                                           for _ in range(blocks)]))
    covers = {c.covers for c in candidates(model, device="cpu")}
    assert all(((f"1.{i}",) in covers) == alone for i in range(blocks))
    assert ("1",) in covers  # the stage is there either way


def test_the_notes_say_where_autoplans_own_time_went():
    plan, report = sw.autoplan(mlp, BATCH, budget=0.45, **FAST)
    (line,) = [n for n in report.notes if n.startswith("autoplan's own time:")]
    assert "s measuring" in line and "s verifying" in line and f"plan: {plan}" in report.notes
