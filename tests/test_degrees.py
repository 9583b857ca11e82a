"""labkit.degrees: the one record of the parallel degrees, and its one list of rules."""
from dataclasses import fields

import pytest

from labkit.costs import memory
from labkit.costs.plan_inputs import Config
from labkit.degrees import Degrees, factorizations, zero_problem
from labkit.parallel import Plan
from labkit.topology import Topology, TopologyError


def test_world_is_the_product_and_every_problem_is_listed_at_once():
    d = Degrees(dp=2, tp=2, pp=2, ep=3, zero=4)
    assert d.world == 8
    found = d.problems(world=6)
    assert len(found) == 3
    assert "2 x 2 x 2 = 8, but the world has 6 ranks" in found[0] and "For example" in found[0]
    assert "ZeRO stage" in found[1] and "ep=3 must divide dp=2" in found[2]
    with pytest.raises(ValueError, match="; "):
        d.check(world=6)


@pytest.mark.parametrize("kw,needle", [
    (dict(dp=0), "dp must be a positive integer, got 0"),
    (dict(tp=True), "tp must be a positive integer, got True"),
    (dict(tp=2, zero=1), "dp=1: nothing to shard over"),
    (dict(dp=4, ep=2, zero=3), "ZeRO-3 with ep=2"),
])
def test_each_rule_says_what_to_change(kw, needle):
    (problem,) = Degrees(**kw).problems()
    assert needle in problem


def test_factorizations_cover_the_world():
    assert all(p * d * t == 12 for p, d, t in factorizations(12))
    assert len(set(factorizations(12))) == len(factorizations(12)) == 18


def test_topology_holds_degrees_and_raises_their_problems_as_its_own_error():
    topo = Topology(8, dp=2, tp=2, pp=2, zero=1)
    assert topo.degrees == Degrees(dp=2, tp=2, pp=2, zero=1)
    with pytest.raises(TopologyError, match="must multiply to 8"):
        Topology(8, dp=2, tp=2)


def test_a_cost_model_prices_zero_over_one_rank_a_launch_refuses_it():
    d = Degrees(tp=8, zero=3)
    assert d.problems(launch=False) == []
    assert "nothing to shard over" in d.problems()[0]


def test_every_record_of_the_degrees_takes_them_by_keyword_in_one_order():
    """Degrees, Plan, Config and Topology list dp, tp, pp, cp, ep, zero in one order, and a
    positional call (the exercises' old Config(tp, pp, dp, ...)) is a TypeError, not a swap."""
    order = [f.name for f in fields(Degrees)]
    assert order == ["dp", "tp", "pp", "cp", "ep", "zero"]
    for cls in (Plan, Config, Topology):
        assert [f.name for f in fields(cls) if f.name in order] == \
            [n for n in order if n in {f.name for f in fields(cls)}], cls
    for make in (lambda: Degrees(2, 2), lambda: Plan(2, 2), lambda: Config(8, 4, 8),
                 lambda: Topology(8, 2, 2, 2)):
        with pytest.raises(TypeError):
            make()
    assert Config(dp=8, tp=4, pp=2).degrees == Degrees(dp=8, tp=4, pp=2)
    assert Plan(dp=2, tp=2, zero=1).topology().degrees == Degrees(dp=2, tp=2, zero=1)


def test_one_message_for_a_zero_that_is_no_stage_of_zero():
    with pytest.raises(ValueError, match=r"zero \(the ZeRO stage\) must be 0, 1, 2 or 3, got 4"):
        memory.model_states(1e9, recipe="mixed", zero=4)
    assert zero_problem(4) in Degrees(zero=4).problems()
