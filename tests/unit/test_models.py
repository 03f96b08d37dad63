"""Model zoo: shapes, parameter counts worked by hand, seeding, errors."""

import pytest
import torch

from flowerdro.models import MODEL_NAMES, build_model, count_parameters, parse_hidden


@pytest.mark.parametrize("name,shape", [("logreg", (1, 28, 28)), ("mlp", (1, 28, 28)), ("cnn_mnist", (1, 28, 28)),
                                        ("cnn_fmnist", (1, 28, 28)), ("cnn_cifar10", (3, 32, 32)),
                                        ("cnn_femnist", (1, 28, 28)), ("lenet", (1, 28, 28)), ("lenet", (3, 32, 32)),
                                        ("logreg", (60,)), ("mlp", (108,))])
def test_output_shape(name, shape):
    model = build_model(name, shape, 10, seed=0)
    assert model(torch.zeros(4, *shape)).shape == (4, 10)


def test_parameter_counts_by_hand():
    assert count_parameters(build_model("logreg", (1, 28, 28), 10)) == 784 * 10 + 10
    assert count_parameters(build_model("mlp", (1, 28, 28), 10, hidden="128,64")) == (
        784 * 128 + 128 + 128 * 64 + 64 + 64 * 10 + 10)
    # LeNet-5 on CIFAR-10: conv 3->6 (5x5), conv 6->16 (5x5), 400->120->84->10
    assert count_parameters(build_model("lenet", (3, 32, 32), 10)) == (
        3 * 6 * 25 + 6 + 6 * 16 * 25 + 16 + 400 * 120 + 120 + 120 * 84 + 84 + 84 * 10 + 10)


def test_seed_gives_same_weights_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_model("mlp", (20,), 3, seed=7)
    after = torch.rand(1)
    b = build_model("mlp", (20,), 3, seed=7)
    assert before == after
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_errors_name_the_parameter():
    with pytest.raises(ValueError, match="model.*allowed"):
        build_model("resnet", (3, 32, 32), 10)
    with pytest.raises(ValueError, match="input_shape"):
        build_model("cnn_mnist", (784,), 10)
    with pytest.raises(ValueError, match="hidden"):
        parse_hidden("128,-1")
    with pytest.raises(ValueError, match="num_classes"):
        build_model("logreg", (5,), 1)
    assert "logreg" in MODEL_NAMES
