"""autoplan's candidates: regions and blocks read from the module tree and the model's own forward."""

import copy

import pytest
import torch
import torch.nn as nn

import shrinkwrap as sw
from shrinkwrap.autoplan import candidates
from shrinkwrap.select import block_groups

from autoplan_helpers import Block, mlp


pytestmark = pytest.mark.usefixtures("one_thread")


def test_candidates_come_from_the_module_tree():
    model = mlp()
    assert block_groups(model) == [("1", ["1.0", "1.1", "1.2", "1.3"], False)]
    found = [str(c) for c in candidates(model, device="cpu")]
    assert found == ["checkpoint(('1',))", "checkpoint(('1.0',))", "checkpoint(('1.1',))", "checkpoint(('1.2',))",
                     "checkpoint(('1.3',))", "swish()"]
    lossy = [str(c) for c in candidates(model, allow_lossy=True, device="cpu")]
    assert lossy[-1] == "autocast(torch.bfloat16)"


class Res(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Sequential(nn.Linear(4, 4), nn.ReLU()))

    def forward(self, x):
        return x + self.body(x)


def test_groups_inside_residual_blocks_are_left_out():
    model = nn.Sequential(nn.Sequential(Res(), Res()), nn.Sequential(Res(), Res()))
    assert block_groups(model) == [("", ["0", "1"], False), ("0", ["0.0", "0.1"], True), ("1", ["1.0", "1.1"], True)]
    assert [str(c) for c in candidates(model, device="cpu")] == [
        "checkpoint(('0',))", "checkpoint(('1',))", "checkpoint(('0.0', '0.1'))", "checkpoint(('1.0', '1.1'))"]


def test_stages_of_blocks_two_levels_down_give_every_block_a_region_of_its_own():
    # ConvNeXt's and Swin's shape: features = [stem, stage of blocks, downsample, stage of blocks].
    features = nn.Sequential(nn.Linear(8, 8), nn.Sequential(*[Block() for _ in range(3)]),
                             nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)), nn.Sequential(*[Block() for _ in range(4)]))
    model = nn.Sequential(features, nn.Linear(8, 1))
    groups = block_groups(model)
    assert ("0.1", ["0.1.0", "0.1.1", "0.1.2"], True) in groups
    covers = [c.covers for c in candidates(model, device="cpu")]
    assert ("0.1",) in covers and ("0.3",) in covers  # each stage as one region
    assert ("0.1.0", "0.1.1", "0.1.2") in covers and ("0.3.0", "0.3.1", "0.3.2", "0.3.3") in covers  # a region a block
    assert ("0.3.0", "0.3.1") in covers and ("0.3.2", "0.3.3") in covers  # each half's blocks
    assert ("0.1.0", "0.1.1") not in covers  # three blocks: no halves
    # A region a block: applied, each block is its own checkpoint, the stage is not.
    plan = next(c for c in candidates(model, device="cpu") if c.covers == ("0.1.0", "0.1.1", "0.1.2"))
    applied = sw.apply(model, sw.Plan(plan.steps))
    assert sw.records(applied)[0].matched == ("0.1.0", "0.1.1", "0.1.2")
    from shrinkwrap.transforms.checkpoint import CheckpointModule

    stage = applied[0][1]
    assert not isinstance(stage, CheckpointModule) and all(isinstance(b, CheckpointModule) for b in stage)


class Layer(Block):
    """A block of three layers with parameters (a ConvNeXt block's convolution, norm and MLP)."""

    def __init__(self):
        super().__init__()
        self.mlp.insert(0, nn.LayerNorm(8))


class Stage(nn.Module):
    """timm's ConvNeXt stage: a module of its own holding a downsample and a Sequential of blocks."""

    def __init__(self, n):
        super().__init__()
        self.downsample = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8))
        self.blocks = nn.Sequential(*[Layer() for _ in range(n)])

    def forward(self, x):
        return self.blocks(self.downsample(x))


def test_the_blocks_of_a_stage_of_a_class_of_its_own_are_found():
    from shrinkwrap.select import blocks_by_depth

    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(Stage(2), Stage(3)), nn.Linear(8, 1))
    groups = block_groups(model)
    assert groups == [("1", ["1.0", "1.1"], False), ("1.0.blocks", ["1.0.blocks.0", "1.0.blocks.1"], True),
                      ("1.1.blocks", ["1.1.blocks.0", "1.1.blocks.1", "1.1.blocks.2"], True)]
    assert blocks_by_depth(model) == [["1.0", "1.1"], ["1.0.blocks.0", "1.0.blocks.1", "1.1.blocks.0", "1.1.blocks.1",
                                                       "1.1.blocks.2"]]
    covers = [c.covers for c in candidates(model, device="cpu")]
    assert ("1.0",) in covers and ("1.1.blocks.0", "1.1.blocks.1", "1.1.blocks.2") in covers


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        return self.o(self.q(x) * self.k(x) + self.v(x))


class MoELayer(nn.Module):
    """A transformer layer with a stack of experts beside its attention (Mixtral's shape)."""

    def __init__(self):
        super().__init__()
        self.attn, self.experts = Attention(), nn.ModuleList([Layer() for _ in range(3)])

    def forward(self, x):
        x = x + self.attn(x)
        return x + sum(e(x) for e in self.experts)


def test_a_layer_with_a_stack_beside_a_layer_of_its_own_is_a_block_not_a_stage():
    from shrinkwrap.select import blocks_by_depth

    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(MoELayer(), MoELayer()), nn.Linear(8, 1))
    assert block_groups(model) == [("1", ["1.0", "1.1"], False)]  # the experts alone would leave attn out
    assert blocks_by_depth(model) == [["1.0", "1.1"]]


class EmbedStage(Stage):
    """timm's FastViT stage: a patch embedding of a layer's size beside its Sequential of blocks."""

    def __init__(self, n):
        super().__init__(n)
        self.downsample = Layer()


def test_a_stage_with_a_layer_beside_its_stack_keeps_that_layer_as_a_block_of_the_finer_grain():
    from shrinkwrap.select import blocks_by_depth

    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(EmbedStage(2), EmbedStage(2)), nn.Linear(8, 1))
    assert blocks_by_depth(model) == [["1.0", "1.1"], ["1.0.downsample", "1.0.blocks.0", "1.0.blocks.1",
                                                       "1.1.downsample", "1.1.blocks.0", "1.1.blocks.1"]]


class Ghost(nn.Module):
    """GhostNet's bottleneck: a residual block whose forward calls two layers by name."""

    def __init__(self):
        super().__init__()
        self.ghost1, self.ghost2 = Layer(), Layer()

    def forward(self, x):
        return x + self.ghost2(self.ghost1(x))


def test_a_block_alone_in_a_container_is_a_block_and_not_looked_inside():
    # timm's GhostNet: stages of one bottleneck each, beside stages of several. The lone bottleneck
    # is the block, as its brothers are: its two Ghost modules are no stack of blocks.
    from shrinkwrap.select import blocks_by_depth

    model = nn.Sequential(nn.Sequential(Ghost()), nn.Sequential(Ghost(), Ghost()), nn.Sequential(Ghost()))
    assert block_groups(model) == [("", ["0", "1", "2"], False), ("1", ["1.0", "1.1"], True)]
    assert blocks_by_depth(model) == [["0", "1", "2"], ["0", "1.0", "1.1", "2"]]


def test_a_module_shared_under_two_names_is_one_block():
    shared = Layer()
    model = nn.Sequential(nn.Sequential(Layer(), shared), nn.Sequential(shared, Layer()))
    # "1.0" is "0.1" again: named once, so the second stack holds one block, and is none.
    assert block_groups(model) == [("", ["0", "1"], False), ("0", ["0.0", "0.1"], True)]


def test_blocks_come_a_grain_at_each_depth_of_the_stacks():
    from shrinkwrap.select import blocks_by_depth, innermost_blocks

    # A stack of stages of stages of blocks, beside a stage of blocks and a downsample: three grains.
    inner = [nn.Sequential(*[Block() for _ in range(2)]) for _ in range(2)]
    features = nn.Sequential(nn.Sequential(*inner), nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)),
                             nn.Sequential(*[Block() for _ in range(3)]))
    model = nn.Sequential(features, nn.Linear(8, 1))
    grains = blocks_by_depth(model)
    assert grains == [["0.0", "0.1", "0.2"],
                      ["0.0.0", "0.0.1", "0.1", "0.2.0", "0.2.1", "0.2.2"],
                      ["0.0.0.0", "0.0.0.1", "0.0.1.0", "0.0.1.1", "0.1", "0.2.0", "0.2.1", "0.2.2"]]
    assert sorted(grains[-1]) == sorted(innermost_blocks(model))
    assert blocks_by_depth(mlp()) == [["1.0", "1.1", "1.2", "1.3"]]  # one stack, one grain
    assert blocks_by_depth(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == []


class Dense(nn.ModuleDict):
    """A DenseNet's dense block: a ModuleDict of layers, each fed what came before."""

    def __init__(self, n=3, width=4):
        super().__init__({f"layer{i}": nn.Sequential(nn.Linear(width * (i + 1), width), nn.ReLU()) for i in range(n)})

    def forward(self, x):
        for layer in self.values():
            x = torch.cat([x, layer(x)], dim=1)
        return x


def test_layers_of_a_module_dict_are_blocks_each_its_own_region():
    model = nn.Sequential(nn.Linear(4, 4), Dense(), nn.Linear(16, 1))
    assert block_groups(model) == [("1", ["1.layer0", "1.layer1", "1.layer2"], False)]
    region = next(c for c in candidates(model, device="cpu") if c.covers == ("1.layer0",))
    x = torch.randn(8, 4, dtype=torch.float64)
    plain = model.double()
    applied = sw.apply(copy.deepcopy(plain), sw.Plan(region.steps))
    assert sw.records(applied)[0].matched == ("1.layer0",)
    plain(x).sum().backward()
    applied(x).sum().backward()
    for (name, a), b in zip(plain.named_parameters(), applied.parameters()):
        assert torch.equal(a.grad, b.grad), name


class Inception(nn.Module):
    """GoogLeNet's block: branches of conv-bn-like pairs, their outputs concatenated."""

    def __init__(self, width=4):
        super().__init__()
        pair = lambda: nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width))  # noqa: E731
        self.branch1 = pair()
        self.branch2 = nn.Sequential(pair(), pair())

    def forward(self, x):
        return torch.cat([self.branch1(x), self.branch2(x)], dim=1)[:, : x.shape[1]]


class Stem(nn.Module):
    """A model whose own forward calls its blocks by name, as GoogLeNet's does, a pooling between."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = (nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)) for _ in range(2))
        self.a, self.b, self.c = Inception(), Inception(), Inception()
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        x = self.b(self.a(self.conv2(self.conv1(x)))).relu()
        return self.head(self.c(x))


class Residual(nn.Module):
    """A residual block of leaf modules only (a ResNet's BasicBlock)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4)

    def forward(self, x):
        return x + self.fc2(self.norm(self.fc1(x)).relu())


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.layers = nn.Linear(4, 4), nn.Sequential(Residual(), Residual())

    def forward(self, x):
        return self.layers(self.stem(x))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.mlp = Block(4), Block(4)

    def forward(self, x):
        return self.mlp(self.attn(x))


class Stack(nn.Module):
    """A T5 stack: a ModuleList of layers whose parts have parts."""

    def __init__(self):
        super().__init__()
        self.block = nn.ModuleList([Layer(), Layer()])

    def forward(self, x):
        for layer in self.block:
            x = layer(x)
        return x


class EncoderDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder, self.decoder = Stack(), Stack()

    def forward(self, x):
        return self.decoder(self.encoder(x)).sum(1, keepdim=True)


def test_blocks_a_model_s_own_forward_calls_by_name_are_a_stack_and_their_branches_are_left_out():
    # GoogLeNet and Inception-v3 hold their Inception modules as attributes of the model, not in a
    # Sequential: those are the blocks, each a region (not the pairs inside their branches, nor
    # the stem's pairs, which hold nothing with parts of its own).
    model = Stem()
    assert block_groups(model) == [("", ["a", "b", "c"], False)]
    covers = [c.covers for c in candidates(model, device="cpu")]
    assert ("a",) in covers and ("c",) in covers and not any(n.startswith("a.") for c in covers for n in c)
    x = torch.randn(8, 4, dtype=torch.float64)
    plain = model.double()
    applied = sw.apply(copy.deepcopy(plain), sw.Plan(next(c for c in candidates(plain, device="cpu")
                                                         if c.covers == ("b",)).steps))
    plain(x).sum().backward()
    applied(x).sum().backward()
    for (name, a), b in zip(plain.named_parameters(), applied.parameters()):
        assert torch.equal(a.grad, b.grad), name
    # Modules of one type that hold stacks of layers (an encoder and a decoder; two towers of
    # residual blocks or of Inception modules): the layers are the blocks.
    assert block_groups(EncoderDecoder()) == [("encoder.block", ["encoder.block.0", "encoder.block.1"], False),
                                              ("decoder.block", ["decoder.block.0", "decoder.block.1"], False)]
    towers = nn.Module()
    towers.a, towers.b = Tower(), Tower()
    assert block_groups(towers) == [("a.layers", ["a.layers.0", "a.layers.1"], False),
                                    ("b.layers", ["b.layers.0", "b.layers.1"], False)]
    towers.a, towers.b = Stem(), Stem()
    assert block_groups(towers) == [("a", ["a.a", "a.b", "a.c"], False), ("b", ["b.a", "b.b", "b.c"], False)]
