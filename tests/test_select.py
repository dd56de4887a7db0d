import pytest
import torch.nn as nn

import shrinkwrap as sw
from shrinkwrap.select import SelectionError, select

from toymodels import Block, Net


def test_regex_is_a_full_match_on_the_dotted_name():
    m = Net()
    assert select(m, r"layer[12]") == ["layer1", "layer2"]
    assert select(m, r"layer1\..*") == [n for n, _ in m.named_modules() if n.startswith("layer1.")]


def test_type_tuple_names_and_predicate():
    m = Net()
    assert select(m, Block) == ["layer1", "layer2", "layer3"]
    assert select(m, (nn.Linear, nn.Dropout)) == ["layer1.drop", "layer2.drop", "layer3.drop", "head"]
    assert select(m, ["head", "layer2.bn1"]) == ["layer2.bn1", "head"]
    assert select(m, lambda mod, name: name.endswith("conv2")) == ["layer1.conv2", "layer2.conv2", "layer3.conv2"]


def test_root_is_never_selected():
    m = Net()
    assert "" not in select(m, ".*")
    assert "" not in select(m, Net, allow_empty=True)
    with pytest.raises(SelectionError):
        select(m, Net)


def test_outermost_drops_matches_inside_matches():
    assert select(Net(), r"layer1.*", outermost=True) == ["layer1"]


def test_nothing_matched_names_the_pattern_and_close_names():
    with pytest.raises(SelectionError) as err:
        select(Net(), r"layer[45]")
    msg = str(err.value)
    assert "'layer[45]'" in msg and "layer1" in msg


def test_invalid_regex_names_the_pattern():
    with pytest.raises(SelectionError, match=r"invalid regular expression 'layer\['"):
        select(Net(), "layer[")


def test_unknown_names_in_a_list_are_an_error():
    with pytest.raises(SelectionError, match="no module named 'layer9'"):
        select(Net(), ["layer1", "layer9"])


def test_selection_sees_through_wrappers():
    m = sw.apply_checkpoint(Net(), "layer1")
    assert select(m, Block) == ["layer1", "layer2", "layer3"]
