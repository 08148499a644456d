"""OutputPlan: a verify asks the model for exactly the logits the decoder reads."""

from lopa.decoding.executor import BranchWindow
from lopa.execution.local import OutputPlan


def test_masked_positions_read_the_output_one_position_earlier() -> None:
    windows = [BranchWindow([1, 2, 3, 4], [1] * 4, [12, 13]), BranchWindow([1, 2], [1, 1], [11])]
    plan = OutputPlan(start=10, n_stage=0, windows=windows)
    # row 0: positions 12, 13 -> window indices 1, 2; row 1 (width 4): position 11 -> index 0
    assert plan.outputs == (1, 2, 4) and plan.n_masked == 3 and plan.from_stored == ()


def test_window_index_zero_uses_the_stored_logit() -> None:
    windows = [BranchWindow([7, 7, 7], [1] * 3, [10, 12])]
    plan = OutputPlan(start=10, n_stage=0, windows=windows)
    assert plan.from_stored == (0,)  # position 10 has no predecessor in the window
    assert plan.outputs[1] == 1


def test_each_row_also_returns_its_last_to_cache_output() -> None:
    windows = [BranchWindow([1] * 5, [1] * 5, [14]), BranchWindow([1] * 3, [1] * 3, [])]
    plan = OutputPlan(start=10, n_stage=2, windows=windows)
    assert plan.n_masked == 1
    assert plan.outputs == (3, 1, 5 + 1)  # masked, then index n_stage - 1 of rows 0 and 1
