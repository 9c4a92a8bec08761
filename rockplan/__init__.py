"""rockplan: train a PyTorch model within a memory budget by planned rematerialization.

    from rockplan import Rockmate
    rk = Rockmate(model, sample, budget=0.5)   # same outputs and gradients, less memory
    step = torch.compile(model, backend=rockplan.backend(budget="1GiB"))   # or as a torch.compile backend
"""

from rockplan.backend import backend
from rockplan.memory import measure_step, steady_cpu_heap
from rockplan.module import Rockmate
from rockplan.planner import OutOfTime
from solvers import InfeasibleBudget

__all__ = ["InfeasibleBudget", "OutOfTime", "Rockmate", "backend", "measure_step", "steady_cpu_heap"]
