"""Lightning's loop module paths (`lightning.pytorch.loops`), for code that imports names from
them. lightspeed's loops are the functions of lightspeed/loop.py, read top to bottom; what lives
here is the little that Lightning code reaches for by these paths:

- `_Loop`: the base Lightning's loop classes share (a loop knows its Trainer);
- `_EvaluationLoop._print_results(results, stage)`: the table `validate` and `test` print
  (report/results.py);
- `loops.optimization.automatic.Closure`: the type Lightning hands a Module's `optimizer_step`, and
  the warning cache of "`training_step` returned `None`";
- `loops.utilities._no_grad_context`: runs a loop method under `torch.no_grad` or
  `torch.inference_mode`, as the loop's `inference_mode` says.
"""

from lightspeed.loops.evaluation_loop import _EvaluationLoop
from lightspeed.loops.loop import _Loop

__all__ = ["_EvaluationLoop", "_Loop"]
