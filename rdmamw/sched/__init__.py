"""DSANA: dynamic scheduling of stragglers for BSP training (see docs/dsana.md).

The server measures each worker's per-sample iteration time, classifies the workers
(:mod:`.classify`), re-apportions the round's global mini-batch in proportion to
speed (:mod:`.shares`) when the move pays for itself (:mod:`.cost`), and weights
each gradient by the samples behind it (:mod:`.weights`), so a round is still one
plain BSP step on the whole batch. :class:`Dsana` ties them together."""

from rdmamw.sched.classify import FAILED, FAST, NORMAL, STRAGGLER, Classifier
from rdmamw.sched.cost import CostModel, Verdict
from rdmamw.sched.scheduler import Dsana
from rdmamw.sched.shares import apportion, bounds
from rdmamw.sched.weights import weighted_mean

__all__ = ["FAILED", "FAST", "NORMAL", "STRAGGLER", "Classifier", "CostModel", "Dsana",
           "Verdict", "apportion", "bounds", "weighted_mean"]
