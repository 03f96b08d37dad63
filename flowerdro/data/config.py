"""Data configuration: one frozen, hashable record read from the Flower run config.

`DataConfig` names the data set, how its training split is partitioned over the
clients, how each client's local test set is built and the modifiers applied on top
(the SCAFF-PD "30% of clients keep 30% of their data" reduction, a per-client cap).
It is validated when it is built, so a bad run config fails before any data is
loaded, with a message that names the run-config key and the allowed values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flowerdro.settings import Settings, read_settings, setting, unset

DATASETS: tuple[str, ...] = (
    "synthetic", "fashion_mnist", "mnist", "adult", "cifar10", "robust_regression"
)
"""Data sets `DataConfig.dataset` may name."""

PARTITIONS: tuple[str, ...] = (
    "natural",
    "iid",
    "dirichlet",
    "shards",
    "one-class",
    "pathological",
    "domain",
)
"""Partition schemes `DataConfig.partition` may name."""

TEST_MODES: tuple[str, ...] = ("split", "label-mix")
"""Ways to build a client's local test set (`DataConfig.test_mode`)."""

LABEL_PARTITIONS: tuple[str, ...] = ("iid", "dirichlet", "shards", "one-class", "pathological")
"""Partitions of a labelled training split (all data sets but ``synthetic``)."""

ALLOWED_PARTITIONS: dict[str, tuple[str, ...]] = {
    "synthetic": ("natural",),
    "fashion_mnist": LABEL_PARTITIONS,
    "mnist": LABEL_PARTITIONS,
    "cifar10": LABEL_PARTITIONS,
    "adult": ("natural", "domain", *LABEL_PARTITIONS),
    "robust_regression": ("natural",),
}
"""Partitions each data set supports (``natural`` for Adult is the PhD / non-PhD split)."""

FIXED_NUM_CLASSES: dict[str, int] = {
    "fashion_mnist": 10, "mnist": 10, "cifar10": 10, "adult": 2, "robust_regression": 1
}

REGRESSION_DATASETS: tuple[str, ...] = ("robust_regression",)
"""Data sets with real-valued targets (float32 ``y``, one model output, MSE loss)."""

#: Rows per client of ``robust_regression`` when ``samples-per-client`` is 0 (SCAFF-PD: m_i = 100).
REGRESSION_DEFAULT_SAMPLES = 100

@dataclass(frozen=True)
class DataConfig(Settings):
    """Which data set, how it is split over clients, and each client's test set.

    Frozen and hashable: `load_federated` caches its result per configuration.
    Every field is validated in ``__post_init__``; errors name the run-config key.

    Parameters
    ----------
    dataset : str (default: "synthetic")
        One of ``synthetic``, ``fashion_mnist``, ``mnist``, ``adult``, ``cifar10``.
    partition : str (default: "natural")
        ``natural`` (synthetic: each client draws from its own generated distribution;
        adult: the PhD / non-PhD domains), ``iid``, ``dirichlet``, ``shards``,
        ``one-class`` (client i holds all of class i), ``pathological`` (at most
        `classes_per_client` labels per client) or ``domain`` (adult PhD / non-PhD).
    num_partitions : int (default: 20)
        Number of clients N (``domain`` needs exactly 2).
    seed : int (default: 0)
        Seed of the partition / generation randomness (run-config ``data-seed``,
        else ``seed``).
    data_dir : str (default: "")
        Folder with the data files; ``""`` means the environment variable
        ``FLOWERDRO_DATA``, and without it the Hugging Face hub.
    dirichlet_alpha : float (default: 0.5)
        Concentration α > 0 of the per-class Dirichlet(α·1_N) split.
    shards_per_client : int (default: 2)
        Label-sorted shards per client S ≥ 1 (McMahan et al., 2017).
    classes_per_client : int (default: 2)
        Labels per client k for ``pathological``, 1 ≤ k ≤ number of classes.
    reduce_fraction : float (default: 0.0)
        Fraction f ∈ [0, 1] of clients (round(f·N), chosen with the seed) that keep
        only `reduce_keep` of their training data (SCAFF-PD: 0.3).
    reduce_keep : float (default: 1.0)
        Fraction ∈ (0, 1] of its training data a reduced client keeps (SCAFF-PD: 0.3).
    test_mode : str (default: "split")
        ``split``: the local test set is split (stratified) from the client's own
        partition; ``label-mix``: drawn from the global test split with the client's
        label proportions (for ``one-class``: the whole global test set of its class).
        The adult ``domain`` / ``natural`` partition always tests on the test rows of
        the client's domain; ``synthetic`` has no global test split and allows ``split`` only.
    test_fraction : float (default: 0.2)
        Fraction ∈ (0, 1) of a client's data used for testing.
    validation_fraction : float (default: 0.0)
        Fraction v ∈ [0, 1) of a client's training rows held out as its validation set
        (stratified, seeded by ``data-seed`` and the client); training then sees only the
        other rows, and an evaluate message with ``eval-split = "validation"`` is answered
        on these. 0: no validation set (the training set is unchanged).
    samples_per_client : int (default: 0)
        0 keeps everything; otherwise the cap on each client's training set.
    synthetic_alpha, synthetic_beta : float (default: 1.0)
        α, β ≥ 0 of LEAF's Synthetic(α, β) (model and input heterogeneity).
    synthetic_dim : int (default: 60)
        Input dimension d ≥ 1 of the synthetic data.
    synthetic_classes : int (default: 10)
        Number of classes C ≥ 2 of the synthetic data.
    synthetic_iid : bool (default: False)
        One shared W, b and input mean for all clients (LEAF's Synthetic-IID).
    regression_dim : int (default: 10)
        Dimension d ≥ 1 of ``robust_regression`` (SCAFF-PD §6.1: a ~ N(0, I_d),
        y = ⟨a, x̂ + δ_i⟩). Its training set has ``samples_per_client`` rows per client
        (0 means 100, the paper's m_i) and its test set round(f/(1 − f)·m_i) fresh rows of
        the same client distribution.
    regression_scale : float (default: 1.0)
        c ≥ 0: x̂ ~ N(0, c² I_d).
    regression_shift : float (default: 1.0)
        σ ≥ 0: δ_i ~ N(0, σ² I_d) (client heterogeneity).
    affine_shift_lambda_std, affine_shift_delta_std : float (default: 0.0)
        s_Λ, s_δ ≥ 0: every client's inputs (train and test, any partition) become
        x ↦ Λ_i x + δ_i on the flattened input (d features), with Λ_i = I + s_Λ·G_i and
        δ_i = s_δ·g_i, G_i, g_i standard Gaussian, seeded per client (FedRobust's affine
        distribution shifts; ‖Λ_i − I‖_F ≈ s_Λ·d and ‖δ_i‖₂ ≈ s_δ·√d). 0 and 0: no shift.
    """

    dataset: str = setting("synthetic", "the data set", choices=DATASETS)
    partition: str = setting("natural", "how the training split is divided over the clients", choices=PARTITIONS)
    num_partitions: int = setting(20, "N, the number of clients (partitions)", ge=1)
    seed: int = setting(0, "seed of the partition and of generated data (run config: data-seed, else seed)",
                        key="data-seed", ge=0)
    data_dir: str = setting("", "folder with the data files (empty: FLOWERDRO_DATA, then the Hugging Face hub)")
    dirichlet_alpha: float = setting(0.5, "α of the per-class Dirichlet(α·1) split", gt=0)
    shards_per_client: int = setting(2, "label-sorted shards per client", ge=1)
    classes_per_client: int = setting(2, "labels per client of the pathological partition", ge=1)
    reduce_fraction: float = setting(0.0, "fraction of the clients that keep only reduce-keep of their data",
                                     ge=0, le=1)
    reduce_keep: float = setting(1.0, "fraction of its training data a reduced client keeps", gt=0, le=1)
    test_mode: str = setting("split", "a client's test set: split from its partition, or the global test "
                                      "split with its label mix", choices=TEST_MODES)
    test_fraction: float = setting(0.2, "fraction of a client's data used for testing", gt=0, lt=1)
    validation_fraction: float = setting(0.0, "fraction of a client's training data held out as its validation "
                                              "set (0: none); training sees only the rest", ge=0, lt=1)
    samples_per_client: int = setting(0, "cap on each client's training set (0: no cap)", ge=0)
    synthetic_alpha: float = setting(1.0, "α of LEAF's Synthetic(α, β): model heterogeneity", ge=0)
    synthetic_beta: float = setting(1.0, "β of LEAF's Synthetic(α, β): input heterogeneity", ge=0)
    synthetic_dim: int = setting(60, "input dimension of the synthetic data", ge=1)
    synthetic_classes: int = setting(10, "classes of the synthetic data", ge=2)
    synthetic_iid: bool = setting(False, "one shared model and input mean for all synthetic clients")
    regression_dim: int = setting(10, "dimension d of robust_regression", ge=1)
    regression_scale: float = setting(1.0, "c: x̂ ~ N(0, c² I) in robust_regression", ge=0)
    regression_shift: float = setting(1.0, "σ: the clients' shifts δ_i ~ N(0, σ² I) in robust_regression", ge=0)
    affine_shift_lambda_std: float = setting(0.0, "s_Λ: every client's inputs become Λ_i x + δ_i with "
                                                  "Λ_i = I + s_Λ G_i", ge=0)
    affine_shift_delta_std: float = setting(0.0, "s_δ: δ_i = s_δ g_i of the clients' affine shifts", ge=0)

    def __post_init__(self) -> None:
        """Normalise the names (``fashion-mnist`` → ``fashion_mnist``), then validate every field."""
        for name in ("dataset", "partition", "test_mode"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = value.strip().lower()
                object.__setattr__(self, name, value.replace("-", "_") if name == "dataset" else value)
        super().__post_init__()

    def check(self) -> None:
        """Checks between fields: the partition fits the data set, the class counts, the test mode."""
        allowed = ALLOWED_PARTITIONS[self.dataset]
        if self.partition not in allowed:
            hint = " (use synthetic-iid=true for IID synthetic data)" if self.dataset == "synthetic" else ""
            raise ValueError(f"partition: {self.partition!r} is not available for dataset {self.dataset!r}; "
                             f"allowed: {', '.join(allowed)}{hint}")
        if (self.partition == "domain" or (self.dataset == "adult" and self.partition == "natural")) \
                and self.num_partitions != 2:
            raise ValueError("num-partitions: must be 2 for the adult PhD / non-PhD domain partition "
                             f"(client 0 = Doctorate, client 1 = the rest), got {self.num_partitions}")
        if self.dataset in REGRESSION_DATASETS and self.reduce_fraction > 0 and self.reduce_keep < 1:
            raise ValueError(f"reduce-fraction: not supported for dataset {self.dataset!r} (set "
                             "samples-per-client instead), got reduce-fraction > 0 with reduce-keep < 1")
        num_classes = self.num_classes
        if self.dataset not in REGRESSION_DATASETS and not 1 <= self.classes_per_client <= num_classes:
            raise ValueError(f"classes-per-client: must be in [1, {num_classes}] (num_classes of "
                             f"{self.dataset}), got {self.classes_per_client}")
        if self.partition == "one-class" and self.num_partitions > num_classes:
            raise ValueError(f"num-partitions: partition 'one-class' needs num-partitions <= num_classes, got "
                             f"{self.num_partitions} > {num_classes} for dataset {self.dataset!r}")
        if self.dataset in ("synthetic", *REGRESSION_DATASETS) and self.test_mode != "split":
            raise ValueError(f"test-mode: 'label-mix' needs a global test split, which dataset '{self.dataset}' "
                             f"does not have; allowed for {self.dataset}: split")

    @property
    def is_regression(self) -> bool:
        """Whether the data set has real-valued targets (MSE loss, no accuracy)."""
        return self.dataset in REGRESSION_DATASETS

    @property
    def num_classes(self) -> int:
        """Number of classes of the configured data set (1 for a regression data set)."""
        if self.dataset == "synthetic":
            return self.synthetic_classes
        return FIXED_NUM_CLASSES[self.dataset]

    @classmethod
    def from_run_config(
        cls, run_config: Mapping[str, Any], num_partitions: int | None = None
    ) -> DataConfig:
        """Build a validated `DataConfig` from a Flower run config.

        Parameters
        ----------
        run_config : Mapping[str, Any]
            The run config (``context.run_config``); keys are kebab-case
            (``num-partitions``, ``dirichlet-alpha``, ...). Keys this class does not
            know are ignored; missing keys take the dataclass defaults.
        num_partitions : int | None (default: None)
            Overrides ``num-partitions`` (e.g. the SuperNode's node config).

        Returns
        -------
        DataConfig
            The configuration; ``data-seed`` wins over ``seed``.

        Raises
        ------
        ValueError
            If a value is out of its range or names an unknown data set / partition.

        Examples
        --------
        >>> DataConfig.from_run_config({"dataset": "mnist", "partition": "iid",
        ...                             "num-partitions": 5, "lr": 0.1}).num_partitions
        5
        """
        if not isinstance(run_config, Mapping):
            raise ValueError(f"run_config must be a mapping, got {type(run_config).__name__}")
        config = dict(run_config)
        if unset(config, "data-seed") and not unset(config, "seed"):
            config["data-seed"] = config["seed"]
        fixed = {} if num_partitions is None else {"num_partitions": num_partitions}
        return read_settings(cls, config, **fixed)
