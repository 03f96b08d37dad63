"""Models used by the reproduced papers, selected by name from the run config.

``build_model(name, input_shape, num_classes, **kwargs)`` returns a fresh ``torch.nn.Module``.
Names: ``logreg`` (multinomial logistic regression), ``mlp`` (hidden sizes from
``hidden``, e.g. ``(128, 64)`` for DR-DSGD), ``cnn_mnist`` (small two-layer CNN for MNIST,
FedRobust's setting), ``cnn_cifar10`` / ``cnn_fmnist`` / ``cnn_femnist`` (the FedMGDA+
paper's networks of Tables 2, 3 and 4), ``lenet`` (LeNet-5: conv 6, conv 16, FC 120, 84),
``linear`` (no bias, one output: SCAFF-PD's robust regression).
"""

from flowerdro.models.zoo import MODEL_NAMES, build_model, count_parameters, parse_hidden

__all__ = ["MODEL_NAMES", "build_model", "count_parameters", "parse_hidden"]
