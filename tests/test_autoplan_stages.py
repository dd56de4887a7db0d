"""autoplan's measuring stages: savings measured where they decide the set, a plan grown into the room its time
leaves, and a plan over its time limit searched again."""

import pytest
import torch
import torch.nn as nn

import shrinkwrap as sw
from shrinkwrap.autoplan import candidates

from autoplan_helpers import mlp


pytestmark = pytest.mark.usefixtures("one_thread")


class _Scripted:
    """autoplan's verification against scripted figures: a plan of n single blocks keeps
    1000 - ``saving`` n bytes and takes ``ms(n)``, whatever its candidates' rows said (each block
    measured alone: saves ``saving``, costs ``cost`` ms). The baseline takes 8 ms, the limit is 10."""

    def __init__(self, ms, cost: float, cuda: bool = True, saving: float = 100.0):
        self.ms, self.cost, self.cuda, self.measured, self.saving = ms, cost, cuda, [], saving
        self.prof = sw.measure(nn.Linear(2, 2), torch.randn(2, 2), iterations=1, warmup=1)

    def blocks(self, plan) -> int:
        return sum(len(s.targets(mlp()).matched) for s in plan.steps)

    def verify(self, rounds: int = 4, in_turns=None, by_forward: bool = False):
        """``in_turns(n)``: the ratios of n blocks' rounds timed in turns with the baseline, if any;
        ``by_forward``: the blocks' costs are their forward times (scaled alike as verification learns)."""
        import dataclasses
        import sys

        from shrinkwrap.report import Row

        ap = sys.modules["shrinkwrap.autoplan.stages"]
        script = self

        class Search(ap._Search):
            def measure_chosen(self, plan, isolate=True, beside=()):  # each plan measured once, as Rows caches
                if (str(plan), isolate and script.cuda) not in script.measured:
                    script.measured.append((str(plan), isolate and script.cuda))
                if in_turns is not None:
                    ratios = in_turns(script.blocks(plan))
                    self.ratios[str(plan)] = (sw.Timing((8.0,) * len(ratios)), sw.Timing(tuple(8.0 * r for r in ratios)))
                return Row(plan, dataclasses.replace(script.prof, step_ms=script.ms(script.blocks(plan))))

        search = Search(self, mlp(), lambda r: 1000 - self.saving * self.blocks(r.plan), 1000.0, 8.0, None, 10.0, False,
                        False, 1.25, tolerance=0.0)
        effects = [ap.Effect(c, self.saving, self.cost, priced_by_forward=by_forward) for c in candidates(mlp(), device="cpu")
                   if c.covers and "." in c.covers[0]]
        tried = search.verify(search.search(effects, 1000.0, 8.0), [], effects, rounds)
        return search, tried, search.final(tried)


def test_savings_that_do_not_add_up_are_measured_where_they_decide_the_set():
    # Each block alone saves 100 of 1000 and costs 1 ms; two together keep 700 (the peak moves
    # to what they no longer hold), three 650. For a budget of 750 the sum asks for three blocks
    # (700 predicted); measured, two fit, and are faster. One does not (900): the set stops at two.
    import dataclasses
    import sys

    from shrinkwrap.report import Row

    ap = sys.modules["shrinkwrap.autoplan.stages"]
    keeps = {0: 1000, 1: 900, 2: 700, 3: 650}
    blocks = lambda plan: sum(len(s.targets(mlp()).matched) for s in plan.steps)  # noqa: E731
    prof = sw.measure(nn.Linear(2, 2), torch.randn(2, 2), iterations=1, warmup=1)
    measured = []

    class Search(ap._Search):
        def measure_chosen(self, plan, isolate=True, beside=()):
            if not isolate:  # refined in this process (then measured again where it fits, as Rows caches)
                measured.append(blocks(plan))
            return Row(plan, dataclasses.replace(prof, step_ms=8.0 + blocks(plan)))

    from types import SimpleNamespace

    search = Search(SimpleNamespace(cuda=False), mlp(), lambda r: keeps[blocks(r.plan)], 1000.0, 8.0, 750.0, None, False, False)
    singles = [c for c in candidates(mlp(), device="cpu") if len(c.covers) == 1 and "." in c.covers[0]][:3]
    effects = [ap.Effect(c, 100.0, 1.0 + i / 10) for i, c in enumerate(singles)]
    chosen = search.search(effects, 1000.0, 8.0, 750.0)
    assert len(chosen) == 3  # what the sum asks for
    tried = search.verify(chosen, [], effects, 4)
    best = search.final(tried)
    assert measured == [3, 2] and blocks(best.plan) == 2 and search.fits(best)
    assert best.plan == ap._plan([e.candidate for e in effects[:2]], mlp())  # the costliest was dropped
    # Where the measurement is what the sum said, nothing more is measured.
    keeps.update({2: 800, 3: 700})
    measured.clear()
    tried = search.verify(search.search(effects, 1000.0, 8.0, 750.0), [], effects, 4)
    assert measured == [3] and blocks(search.final(tried).plan) == 3


@pytest.mark.parametrize("cuda", [True, False])
def test_without_a_budget_a_plan_that_fits_is_grown_while_its_measured_time_leaves_room(cuda):
    # Rows of 1.5 ms predict one block within 10 ms; measured, two take 9 ms, and a third is predicted over.
    script = _Scripted(lambda n: 8 + 0.5 * n, cost=1.5, cuda=cuda)
    search, tried, best = script.verify()
    assert [script.blocks(r.plan) for r in tried] == [1, 2] and script.blocks(best.plan) == 2
    assert search.fits(best)
    fresh = [text for text, isolated in script.measured if isolated]
    assert fresh == ([str(best.plan)] if cuda else [])  # only the answer measured fresh


def test_a_plan_that_fits_is_not_grown_by_what_would_save_less_than_alike_memory():
    # The same times as above, each block saving 1% of the memory: two blocks would be plans of
    # alike memory (SAME_MEMORY), of which the answer is the faster, one block; no round grows it.
    script = _Scripted(lambda n: 8 + 0.5 * n, cost=1.5, saving=10.0)
    search, tried, best = script.verify()
    assert [script.blocks(r.plan) for r in tried] == [1] and search.fits(best)


def test_a_plan_that_fits_is_grown_only_into_the_room_its_timing_in_turns_surely_leaves():
    # One block: its row reads 8.5 ms, room for another at 1.5 ms under the 10 ms limit. Timed in
    # turns it is 1.1x the baseline (8.8 ms) by its median, but up to 1.24x (9.92 ms): no room.
    script = _Scripted(lambda n: 8 + 0.5 * n, cost=1.5)
    search, tried, best = script.verify(in_turns=lambda n: [1.0, 1.05, 1.1, 1.2, 1.24])
    assert [script.blocks(r.plan) for r in tried] == [1] and search.fits(best)
    # Tight timings at 1.0x leave the room, and the plan grows.
    script = _Scripted(lambda n: 8 + 0.5 * n, cost=1.5)
    search, tried, best = script.verify(in_turns=lambda n: [1.0, 1.0, 1.0, 1.01, 1.01] if n == 1 else [1.2] * 5)
    assert [script.blocks(r.plan) for r in tried] == [1, 2]


def test_a_grown_plan_over_the_time_limit_leaves_the_smaller_one_the_answer_measured_fresh():
    # Two blocks predicted at 10 ms take 9; a third, predicted at 10, takes 11; no round is left after it.
    script = _Scripted(lambda n: {0: 8, 1: 8.5, 2: 9.0}.get(n, 11.0), cost=1.0)
    search, tried, best = script.verify(rounds=2)
    assert [script.blocks(r.plan) for r in tried] == [2, 3]
    assert script.blocks(best.plan) == 2 and search.fits(best)
    assert [text for text, isolated in script.measured if isolated] == [str(best.plan)]


def test_a_plan_over_the_time_limit_raises_its_candidates_costs_by_what_it_missed_and_is_searched_again():
    # Rows said 0.5 ms a block, so all four fit 10 ms by prediction; each really costs 2. Measured at
    # 16 ms, the 6 ms missed is shared among the four, and the search picks one block, which fits. Dropping
    # the costliest one round at a time would have measured three blocks (14 ms) in the second round.
    script = _Scripted(lambda n: 8 + 2.0 * n, cost=0.5)
    search, tried, best = script.verify(rounds=2)
    assert [script.blocks(r.plan) for r in tried] == [4, 1]
    assert script.blocks(best.plan) == 1 and search.fits(best)


def test_a_plan_that_fits_is_not_grown_back_into_a_set_measured_over_the_time_limit():
    # Blocks priced at 1 ms: two predicted at 10 ms take 12. Their prices double, one block is
    # chosen and takes 8 ms, and its room (2 ms) would predict one more block within 10 ms: back
    # to a set over the limit already (efficientnet_b0 on an H200 went 1.10x, 0.82x, 1.10x).
    script = _Scripted(lambda n: {0: 8.0, 1: 8.0}.get(n, 12.0), cost=1.0)
    search, tried, best = script.verify(by_forward=True)
    assert [script.blocks(r.plan) for r in tried] == [2, 1]  # before: 2, 1, 2, 1
    assert script.blocks(best.plan) == 1 and search.fits(best)


def _rows_search(max_t):
    """A search over rows made up here: ``row(mem, ms)`` reads ``mem`` in ``ms``."""
    import dataclasses
    import sys
    from types import SimpleNamespace

    from shrinkwrap.report import Row

    ap = sys.modules["shrinkwrap.autoplan.stages"]
    prof = sw.measure(nn.Linear(2, 2), torch.randn(2, 2), iterations=1, warmup=1)
    mems = {}

    def row(mem, ms):
        plan = sw.Plan([sw.checkpoint(f"layer{len(mems)}")])
        mems[str(plan)] = mem
        return Row(plan, dataclasses.replace(prof, step_ms=ms))

    search = ap._Search(SimpleNamespace(cuda=True), mlp(), lambda r: mems[str(r.plan)], 1000.0, 10.0, None, max_t,
                        False, False, None if max_t is None else max_t / 10.0, tolerance=0.0)
    return search, row


def test_a_plan_within_a_tenth_of_the_least_memory_and_a_tenth_faster_answers_instead():
    search, row = _rows_search(max_t=30.0)
    least, compiled_recipe, slightly = row(200, 27.0), row(212, 13.5), row(205, 26.0)
    # 6% more memory at half the time answers (the user asked for speed within the memory);
    # 2.5% more memory at 4% less time does not beat the least (noise, not a trade).
    assert search.final([least, slightly, compiled_recipe]) is compiled_recipe
    assert search.final([least, slightly]) is least
    # From there again: 9% over it and 10% faster again, still within a tenth over the least's 200.
    again = row(221, 12.0)
    assert search.final([least, compiled_recipe, again]) is again
    # Never 10% or more over the least: a row with a tenth less memory would beat that one in turn.
    too_big = row(225, 5.0)
    assert search.final([least, too_big]) is least
    # Over the time limit, nothing answers, however small.
    assert search.final([row(100, 31.0), least]) is least


def test_no_answer_is_beaten_by_a_row_it_measured():
    import random

    rng = random.Random(0)
    for _ in range(200):
        search, row = _rows_search(max_t=30.0)
        rows = [row(rng.uniform(100, 140), rng.uniform(5, 30)) for _ in range(rng.randint(1, 8))]
        answer = search.final(rows)
        mem, t = search.metric(answer), answer.profile.step_ms
        least = min(search.metric(x) for x in rows)
        for r in rows:
            # at least 10% less memory within the limit, or within 10% of it and 10% faster: neither
            # exists beside the answer, but for a row that the first rule itself would outdo
            assert not search.metric(r) <= 0.9 * mem
            if search.metric(r) <= 1.1 * mem and r.profile.step_ms <= 0.9 * t:
                assert search.metric(r) * 0.9 >= least
