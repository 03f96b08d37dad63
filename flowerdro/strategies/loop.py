"""The settings every strategy shares: the round loop's, and how field overrides reach each settings object."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from flowerdro.protocol import TrainingSettings
from flowerdro.settings import Settings, setting

__all__ = ["EmptySettings", "LoopSettings", "split_settings"]


@dataclass(frozen=True)
class LoopSettings(Settings):
    """Settings of the round loop every strategy shares."""

    fraction_train: float = setting(1.0, "fraction of the connected clients sampled for training", gt=0, le=1)
    min_train_nodes: int = setting(1, "at least this many clients are sampled for training", ge=1)
    fraction_evaluate: float = setting(1.0, "fraction of the clients asked to evaluate (0: none)", ge=0, le=1)
    evaluate_sample: int = setting(300, "at most this many clients evaluate per round, a seeded sample "
                                        "(0: no cap; the fairness numbers' *_n say how many reported)", ge=0)
    evaluate_every: int = setting(1, "evaluate every k rounds (and always after the last)", ge=1)
    min_available_nodes: int = setting(1, "wait for this many connected clients before a round", ge=1)
    seed: int = setting(0, "seed of sampling, client minibatches and the initial model")
    checkpoint_every: int = setting(0, "save the server state every k rounds (0: never)", ge=0)
    max_failed_rounds: int = setting(3, "stop the run with an error after this many rounds in a row "
                                        "without a valid training reply, or without a valid evaluation", ge=1)
    accuracy_metric: str = setting("test_acc", "the evaluate replies' accuracy metric (fairness numbers); "
                                               "sent to the clients with every evaluate message")
    loss_metric: str = setting("test_loss", "the evaluate replies' loss metric; sent with every evaluate message")
    eval_metric: str | None = setting(None, "the metric every evaluate reply must carry (unset: "
                                            "accuracy-metric, or loss-metric on a regression data set)")


@dataclass(frozen=True)
class EmptySettings(Settings):
    """Settings of a strategy that has none of its own."""


def split_settings(settings_class: type[Settings], config: Settings | None, loop: LoopSettings | None,
           training: TrainingSettings | None, fields_: dict[str, Any]
           ) -> tuple[Settings, LoopSettings, TrainingSettings]:
    """Distribute field overrides by name over the algorithm, loop and training settings."""
    groups: list[tuple[type[Settings], Settings | None]] = [
        (settings_class, config), (LoopSettings, loop), (TrainingSettings, training)]
    out = []
    left = dict(fields_)
    for cls, obj in groups:
        names = {f.name for f in fields(cls)}
        mine = {k: left.pop(k) for k in list(left) if k in names}
        if obj is None:
            obj = cls(**mine)
        elif mine:
            obj = replace(obj, **mine)
        out.append(obj)
    if left:
        raise TypeError(f"{settings_class.__name__}: unknown settings {sorted(left)}")
    return out[0], out[1], out[2]  # type: ignore[return-value]
