"""Steps whose loss has no element that carries weight (every frame masked out: loss masks, Animate's continuation
frames on clips no longer than them, concepts weighted 0) train nothing, whatever loss they log. Each is counted
(BaseWanSetup.loss_bearing_elements, read back with the losses); the first is warned about, and a run whose every
step is such a step stops before its final save instead of saving a model as if trained."""
import logging

from modules.trainer.errors import TrainingError
from modules.util.ranks import any_rank

log = logging.getLogger(__name__)


def count_loss_bearing(trainer, step: int, bearing: float) -> None:
    """Counts step `step`, whose loss had `bearing` elements with weight on this rank."""
    if bearing > 0:
        trainer.loss_bearing_steps += 1
        return
    trainer.empty_steps += 1
    if trainer.empty_steps == 1:
        log.warning("step %d: no element of its loss carries weight (every frame masked out: loss masks, "
                    "animate.continuation_frames, a concept's loss_weight 0): the step trains nothing", step)


def check_something_trained(trainer) -> None:
    """Raises TrainingError when no step of this session had a loss-bearing element on any rank (every rank calls
    it: a collective)."""
    trainer.read_losses()
    trained = any_rank(trainer.loss_bearing_steps > 0)
    if trainer.empty_steps and not trained:
        raise TrainingError(f"no step of this run trained anything: in each of its {trainer.empty_steps} steps every "
                            f"element of the loss was masked out (loss masks, animate.continuation_frames not shorter "
                            f"than the clips, concepts' loss_weight 0); no model is saved. Check the data report's "
                            f"buckets and masks")
